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
- the environment's generation: every write to os.environ (a set, change or delete, monkeypatch and
  mock.patch.dict included) starts a new one (Note [Watched environment]), so that a knob set, changed
  or unset takes effect at the next call, without reading a knob on the repeated path.

A refused call, a call with RINGREDUCE_DEBUG set or under the profiler takes the full path each time.
forget() drops every Plan (_groups: a destroyed ring's group, and at exit).
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

import torch

from ringreduce import _native


# Note [Watched environment]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Reading the CPU path's eleven knobs at every call cost about 0.4 us of a 1 KiB call's Python part
# (one dict probe each, on os.environ's bytes mapping). Instead os.environ's class becomes a subclass of
# its own that counts writes: __setitem__ and __delitem__ (which update(), pop(), clear() and setdefault()
# go through) bump `generation` after the write. os.environ stays the same object with the same
# behaviour; os.putenv()/unsetenv() called directly bypass it, as they bypass os.environ itself. Where
# os.environ is not the standard library's class (something else replaced it), nothing is patched and
# there is no fast path.
class _WatchedEnviron(os._Environ):  # type: ignore[misc,name-defined]
    """os.environ's class, counting its writes (Note [Watched environment])."""

    def __setitem__(self, key: str, value: str) -> None:
        super().__setitem__(key, value)
        _written()

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        _written()


_generations = itertools.count(1)
generation = 0  # of the environment; a plan made under another one is not run


def _written() -> None:
    global generation
    generation = next(_generations)


def _watch() -> bool:
    cls = type(os.environ)
    if cls.__module__ == __name__:  # this module imported again (importlib.reload)
        return True
    if cls is not os._Environ:  # type: ignore[attr-defined]
        return False
    os.environ.__class__ = _WatchedEnviron
    return True


WATCHING = _watch()
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
MAX_PLANS = 1024  # argument sets kept; a program making more distinct calls than that rebuilds its plans


class Plan:
    """What the checks of one argument set decided: the ring and the native options of its calls."""

    __slots__ = ("group", "kind", "world", "env", "info", "options", "describe", "head", "store", "ring")

    def __init__(self, group: Any, kind: Any, world: Any, env: int, info: Any, options: Any,
                 describe: str) -> None:
        self.group = group  # the `group` argument itself (None: WORLD)
        self.kind = kind  # the call kind (its id is in the key)
        self.world = world  # the default process group when the plan was made
        self.env = env  # the environment's generation when the checks began
        self.info = info  # the ring's GroupInfo
        self.options = options  # the native CallOptions of the call
        self.describe = describe  # what an async call's Work names itself
        # the first arguments of the native submit (_rings.cpu.submit_cpu) and its store
        self.head = (info.pg, info.name, list(info.members))
        self.store = info.store
        # the ring bound once (Note [A bound ring] in csrc/torch/cpu_ops.h); through _native.C at this
        # call, so that a stub put over C.CpuRing (a test's or a measurement's) is the plan's ring
        self.ring = _native.C.CpuRing(*self.head, self.store)


_lock = threading.Lock()
plans: dict[tuple[Any, ...], Plan] = {}


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
