"""The plans of repeated CPU all-reduce calls: what a call's checks decided, kept for the next identical call.

Note [Fast path of a repeated call]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A training loop calls all_reduce with the same few argument sets, step after step. The first call of
a set runs every check (resolve, local_refusal, scaling_refusal, choose_algorithm, call_options); its
outcome (the ring's GroupInfo and the native CallOptions) is kept as a Plan under a key of everything
those checks read:

- the `group` argument, the call kind and the default group (WORLD) at the time, by identity (the
  Plan holds them, so their ids cannot be reused; a re-initialized WORLD is a new object: a miss);
- the tensor's dtype and layout (only a CPU torch.Tensor or nn.Parameter with elements qualifies);
- the arguments, op and predivide_factor with their types (so that True never stands for 1);
- the raw value of every knob the CPU path reads (environment(): CPU_KNOBS), compared at every call,
  so that a knob set, changed or unset takes effect at the next call.

A refused call, a call with RINGREDUCE_DEBUG set or under the profiler takes the full path each time.
forget() drops every Plan (_groups: a destroyed ring's group, and at exit).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ringreduce import _config, _native

# The environment variables whose values a check of the CPU all-reduce path reads.
CPU_KNOBS = ("RINGREDUCE_SEGMENT_BYTES", "RINGREDUCE_SLOTS", "RINGREDUCE_CHECK", "RINGREDUCE_TIMEOUT",
             "RINGREDUCE_DEBUG", "RINGREDUCE_LOCAL_SIZE", "RINGREDUCE_SHM", "RINGREDUCE_WIRE_GATHER", "GROUP_RANK",
             "LOCAL_WORLD_SIZE", "WORLD_SIZE")
GPU_ONLY_KNOBS = ("RINGREDUCE_LANES", "RINGREDUCE_ONESHOT_BYTES", "RINGREDUCE_NCCL_SIMPLE")
ENV_KEYS = tuple(name.encode() for name in CPU_KNOBS)
ENV_GET = _config._ENV_BYTES.get if _config._ENV_BYTES is not None else None
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
MAX_PLANS = 1024  # argument sets kept; a program making more distinct calls than that rebuilds its plans


class Plan:
    """What the checks of one argument set decided: the ring and the native options of its calls."""

    __slots__ = ("group", "kind", "world", "env", "info", "options", "describe", "head", "store", "ring")

    def __init__(self, group: Any, kind: Any, world: Any, env: tuple[bytes | None, ...], info: Any, options: Any,
                 describe: str) -> None:
        self.group = group  # the `group` argument itself (None: WORLD)
        self.kind = kind  # the call kind (its id is in the key)
        self.world = world  # the default process group when the plan was made
        self.env = env  # environment() when the plan was made
        self.info = info  # the ring's GroupInfo
        self.options = options  # the native CallOptions of the call
        self.describe = describe  # what an async call's Work names itself
        # the first arguments of the native submit (_backend.cpu.submit_cpu) and its store
        self.head = (info.pg, info.name, list(info.members))
        self.store = info.store
        # the ring bound once (Note [A bound ring] in csrc/torch/cpu_ops.h); through _native.C at this
        # call, so that a stub put over C.CpuRing (a test's or a measurement's) is the plan's ring
        self.ring = _native.C.CpuRing(*self.head, self.store)


_lock = threading.Lock()
plans: dict[tuple[Any, ...], Plan] = {}


def environment() -> tuple[bytes | None, ...] | None:
    """The raw bytes of every CPU knob (None: unset); None where os.environ keeps no bytes mapping."""
    if ENV_GET is None:
        return None
    return tuple(map(ENV_GET, ENV_KEYS))


def remember(key: tuple[Any, ...], plan: Plan) -> None:
    """Keeps `plan` for `key`."""
    with _lock:
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = plan


def forget() -> None:
    """Drops every plan (a group is being destroyed, or the interpreter exits)."""
    with _lock:
        plans.clear()
