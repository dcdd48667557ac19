"""The implementations compared: ringreduce and the stock torch.distributed all_reduce, each an in-place
all-reduce plus the environment it runs under (set, and taken by ringreduce's rings through
ringreduce.reload_knobs(), as an implementation's round begins, so the check on/off A/B alternates in
one process).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ringreduce

RINGREDUCE = "ringreduce"
RINGREDUCE_NOCHECK = "rr-nocheck"
GLOO = "gloo"
NCCL = "nccl"
NCCL_RING = "nccl-ring"
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# --algorithms: ringreduce with algorithm=
ALGORITHM_NAMES = {"ring": "rr-ring", "hierarchical": "rr-hier", "direct": "rr-direct"}


def direct_wire_name(wire: str) -> str:
    """The name of ringreduce with algorithm="direct" and the 16-bit `wire` (--algorithms direct with
    --wire-dtype): "rr-direct-bf16"."""
    return f"rr-direct-{wire}"


def algorithm_ratio_name(impl: str, stock: str) -> str:
    """The table's time-ratio column of an --algorithms implementation: "ring/gloo", "hier/nccl"."""
    return f"{impl.removeprefix('rr-')}/{stock}"


def wire_names(wire: str) -> tuple[str, str]:
    """The names of ringreduce with a 16-bit `wire` ("bf16"/"fp16") and of DDP's compress hook for it."""
    return f"rr-{wire}", f"ddp-{wire}"


@dataclass
class Impl:
    """One implementation: a name, an in-place all-reduce, the env it needs, how it is checked."""

    name: str
    run: Callable[[torch.Tensor], None]
    env: dict[str, str | None] = field(default_factory=dict)  # None removes the variable
    rtol: float = 0.0  # 0: results must be exact
    column: Any = None  # --vs deepspeed: its DeepSpeedColumn (calls and fallbacks per size)

    def enter(self) -> None:
        """Applies this implementation's environment (outside the timed region); ringreduce's rings read
        their knobs again when it changed one."""
        changed = False
        for key, value in self.env.items():
            changed |= os.environ.get(key) != value
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if changed:
            ringreduce.reload_knobs()


def _ringreduce_call(op: str, **options: Any) -> Callable[[torch.Tensor], None]:
    """ringreduce's all-reduce with `options` (algorithm=, wire_dtype=)."""
    if op == "avg":
        return lambda t: ringreduce.all_reduce_avg(t, **options)
    return lambda t: ringreduce.all_reduce(t, op=ringreduce.ReduceOp.SUM, **options)


def _compress_hook_call(op: str, wire: torch.dtype) -> Callable[[torch.Tensor], None]:
    """DDP's bf16/fp16_compress_hook on one bucket; for --op sum the same without the division."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.bf16_compress_hook if wire == torch.bfloat16 else default_hooks.fp16_compress_hook
    if op == "avg":
        return lambda t: hook(None, (t,)).wait()

    def compress_sum(t: torch.Tensor) -> None:
        c = t.to(wire)
        dist.all_reduce(c)
        t.copy_(c)

    return compress_sum


def _stock_call(op: str, backend: str, world_size: int, group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], None]:
    if op == "sum":
        return lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    if backend == "nccl":
        return lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)

    def sum_then_divide(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t.div_(world_size)

    return sum_then_divide


_RING_GROUPS: dict[str, dist.ProcessGroup] = {}  # one per device and process: a sweep of several types shares it


def _ring_group(device: torch.device) -> dist.ProcessGroup:
    """The NCCL group whose communicator is initialized with NCCL_ALGO=RING (then restored), made by the
    first call on `device` (collective then; every rank makes the same calls)."""
    if str(device) in _RING_GROUPS:
        return _RING_GROUPS[str(device)]
    saved = os.environ.get("NCCL_ALGO")
    os.environ["NCCL_ALGO"] = "RING"
    try:
        group = dist.new_group(backend="nccl")
        dist.all_reduce(torch.zeros(1, device=device), group=group)  # communicator init happens here
        torch.cuda.synchronize(device)
    finally:
        if saved is None:
            os.environ.pop("NCCL_ALGO", None)
        else:
            os.environ["NCCL_ALGO"] = saved
    _RING_GROUPS[str(device)] = group
    return group


def loopback_call(op: str, tensors: list[torch.Tensor]) -> Callable[[], None]:
    """One all-reduce of the one-GPU loopback driver (csrc/cuda/loopback_ring.h) over `tensors`, one per
    simulated rank; synchronous on the current stream."""
    from ringreduce._native import C

    code = int(ringreduce.ReduceOp.AVG if op == "avg" else ringreduce.ReduceOp.SUM)
    return lambda: C._cuda_loopback_all_reduce(tensors, code)


def build_impls(cfg: Any, device: torch.device, dtype: torch.dtype) -> list[Impl]:
    """The implementations to compare, in table order, for the sweep `cfg` (a BenchConfig: its op and
    backend; check, RINGREDUCE_CHECK, None: the library default; check_cost, also ringreduce without
    the check; nccl_ring, also NCCL with NCCL_ALGO=RING; wire_dtype, also ringreduce with that 16-bit
    wire and DDP's compress hook; algorithms, also ringreduce with each algorithm= (with "direct" and a
    wire, direct with the wire too); vs, "deepspeed" or
    None) on `device` with `dtype` tensors.

    Collective: creates every communicator before any is timed, the NCCL_ALGO=RING one last.
    """
    op, backend, check, check_cost = cfg.op, cfg.backend, cfg.check, cfg.check_cost
    nccl_ring, wire, algorithms, vs = cfg.nccl_ring, cfg.wire_dtype, cfg.algorithms, cfg.vs
    n = dist.get_world_size()
    user_check = os.environ.get("RINGREDUCE_CHECK")
    check_env: str | None = user_check if check is None else ("1" if check else "0")
    impls = [Impl(RINGREDUCE, _ringreduce_call(op), {"RINGREDUCE_CHECK": check_env})]
    if check_cost:
        impls.append(Impl(RINGREDUCE_NOCHECK, _ringreduce_call(op), {"RINGREDUCE_CHECK": "0"}))
    # NCCL's AVG multiplies by a rounded 1/n before summing: its result is within n eps.
    rtol = n * torch.finfo(dtype).eps if op == "avg" and backend == "nccl" and dtype.is_floating_point else 0.0
    impls.append(Impl(NCCL if backend == "nccl" else GLOO, _stock_call(op, backend, n, None), rtol=rtol))
    if wire is not None:
        rr_name, ddp_name = wire_names(wire)
        wdt = WIRE_DTYPES[wire]
        # The pattern's sums are exact in 16 bits, so ringreduce's wire is off by at most one rounding
        # (a 16-bit all-gather rounds the average once); the hook divides in 16 bits first: wider.
        impls.append(Impl(rr_name, _ringreduce_call(op, wire_dtype=wdt), {"RINGREDUCE_CHECK": check_env},
                          rtol=float(torch.finfo(wdt).eps)))
        impls.append(Impl(ddp_name, _compress_hook_call(op, wdt), rtol=2.0 * n * torch.finfo(wdt).eps))
    for algo in algorithms:
        impls.append(Impl(ALGORITHM_NAMES[algo], _ringreduce_call(op, algorithm=algo), {"RINGREDUCE_CHECK": check_env}))
    if wire is not None and "direct" in algorithms:
        wdt = WIRE_DTYPES[wire]
        impls.append(Impl(direct_wire_name(wire), _ringreduce_call(op, algorithm="direct", wire_dtype=wdt),
                          {"RINGREDUCE_CHECK": check_env}, rtol=float(torch.finfo(wdt).eps)))
    if vs == "deepspeed":
        from ringreduce.bench.deepspeed_shm import NAME, DeepSpeedColumn

        column = DeepSpeedColumn(op, int(os.environ.get("LOCAL_WORLD_SIZE", n)))
        impls.append(Impl(NAME, column.run, column=column))
    warm = torch.zeros(16, device=device)
    for impl in impls:
        impl.enter()
        impl.run(warm)
    if backend == "nccl" and nccl_ring:
        group = _ring_group(device)
        impls.append(Impl(NCCL_RING, _stock_call(op, backend, n, group), rtol=rtol))
    return impls
