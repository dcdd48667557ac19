"""What every rank runs: for each size, memory probe, warm-up, timed rounds, the memcpy floor and
correctness (the method: benchmarks/README.md "Timing method"); rank 0 gathers and prints as it goes.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.data import count_wrong, fill_pattern, pattern_modulus
from ringreduce.bench.impls import (
    ALGORITHM_NAMES,
    GLOO,
    NCCL,
    RINGREDUCE,
    Impl,
    build_impls,
    direct_wire_name,
    loopback_call,
    wire_names,
)
from ringreduce.bench.memory import measure_call
from ringreduce.bench.metrics import aggregate_size
from ringreduce.bench.sizes import DTYPES, format_size
from ringreduce.bench.timing import CallTimer, auto_iters, summarize, time_round

_ALONE_KEY = "ringreduce.bench/rank0_alone"  # _on_rank0_alone's store keys


@dataclass
class RankContext:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device


def _agree_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _interleaved(impls: list[Impl], round_index: int) -> list[Impl]:
    return impls if round_index % 2 == 0 else impls[::-1]


def _single_calls(impls: list[Impl], calls: dict[str, Callable[[], None]], n: int,
                  device: torch.device) -> dict[str, list[float]]:
    """Seconds of each call of `n` rounds of one call per implementation, alternating (A B B A ...).
    Where the implementation changes, its environment is applied after an untimed barrier; on GPUs the
    previous calls' device work finishes first (the barrier orders host threads only)."""
    timers = {impl.name: CallTimer(device) for impl in impls}
    previous = None
    for i in range(n):
        for impl in _interleaved(impls, i):
            if impl is not previous:
                if previous is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
            impl.enter()
            previous = impl
            timers[impl.name].time(calls[impl.name])
    return {name: timer.seconds() for name, timer in timers.items()}


def measure_size(cfg: BenchConfig, ctx: RankContext, impls: list[Impl], size: int) -> dict[str, Any]:
    """This rank's (`ctx`) measurements of `impls` at `size` bytes under `cfg`."""
    dtype = DTYPES[cfg.dtype].torch_dtype
    count = size // dtype.itemsize
    k = pattern_modulus(dtype, ctx.world_size)
    bufs = {impl.name: torch.empty(count, dtype=dtype, device=ctx.device) for impl in impls}
    calls = {impl.name: (lambda impl=impl: impl.run(bufs[impl.name])) for impl in impls}
    for buf in bufs.values():
        fill_pattern(buf, ctx.rank, k)
    results: dict[str, dict[str, Any]] = {}
    probe_s = {}
    for impl in impls:
        impl.enter()
        t0 = time.perf_counter()
        results[impl.name] = asdict(measure_call(calls[impl.name], ctx.device))
        probe_s[impl.name] = time.perf_counter() - t0

    warm = _single_calls(impls, calls, cfg.warmup, ctx.device)
    estimates = [statistics.median(warm[i.name]) if cfg.warmup else probe_s[i.name] for i in impls]
    rounds = cfg.rounds if cfg.timing == "rounds" else 1
    if cfg.iters is not None:
        iters = cfg.iters
    else:
        iters = auto_iters(_agree_max(max(estimates), ctx.device), cfg.seconds_per_size / rounds, cfg.min_iters,
                           cfg.max_iters)

    floor = torch.empty_like(bufs[impls[0].name])
    source = bufs[impls[0].name]
    per_call: dict[str, list[float]] = {impl.name: [] for impl in impls}
    floor_s: list[float] = []
    if cfg.timing == "rounds":
        for r in range(rounds):
            for impl in _interleaved(impls, r):
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                dist.barrier()  # untimed: every rank starts the round together
                impl.enter()
                per_call[impl.name].append(time_round(calls[impl.name], iters, ctx.device))
            floor_s.append(time_round(lambda: floor.copy_(source), iters, ctx.device))
    else:
        per_call = _single_calls(impls, calls, iters, ctx.device)
        floor_s.append(time_round(lambda: floor.copy_(source), iters, ctx.device))
    for impl in impls:
        results[impl.name].update(summarize(per_call[impl.name]))
        results[impl.name]["floor_us"] = statistics.median(floor_s) * 1e6

    for impl in impls:
        buf = bufs[impl.name]
        fill_pattern(buf, ctx.rank, k)
        impl.enter()
        impl.run(buf)
        results[impl.name]["wrong"] = count_wrong(buf, ctx.world_size, k, cfg.op, impl.rtol)
    if cfg.loopback and ctx.device.type == "cuda":
        _time_loopback(cfg, ctx, count, dtype, k, iters, rounds, lambda: floor.copy_(source), results)
    direct = "direct" in cfg.algorithms
    if cfg.wire_dtype is not None or cfg.vs is not None or direct:
        from ringreduce.bench.accuracy import accuracy

        # --vs: every implementation's error and elements off; --wire-dtype: the float32 and wire errors;
        # --algorithms direct: the ring's and direct's errors and elements off.
        names = {RINGREDUCE}
        if cfg.wire_dtype is not None:
            names.update(wire_names(cfg.wire_dtype))
        if direct:
            names.update((ALGORITHM_NAMES["ring"], ALGORITHM_NAMES["direct"]))
            if cfg.wire_dtype is not None:
                names.add(direct_wire_name(cfg.wire_dtype))
        compared = impls if cfg.vs else [i for i in impls if i.name in names]
        for name, value in accuracy(compared, cfg.op, count, ctx.rank, ctx.world_size, dtype, ctx.device).items():
            results[name].update(value if cfg.vs or direct else {"rel_error": value["rel_error"]})
    for impl in impls:
        if impl.column is not None:  # --vs deepspeed, untimed: the ops one call ran, its calls and fallbacks
            results[impl.name]["profiled_ops"] = impl.column.profiled_ops(bufs[impl.name])
            results[impl.name]["calls"], results[impl.name]["fallback_calls"] = impl.column.counts()
    return {"size": size, "count": count, "iters": iters, "rounds": rounds, "warmup": cfg.warmup, "impls": results}


def _time_loopback(cfg: BenchConfig, ctx: RankContext, count: int, dtype: torch.dtype, k: int, iters: int,
                   rounds: int, copy: Callable[[], Any], results: dict[str, dict[str, Any]]) -> None:
    """Rank 0 times the one-GPU loopback driver over world_size simulated ranks, alone on its GPU, and
    `copy` (a copy of the buffer) in the same rounds (Note [Loopback ideal] in metrics.py); it is checked too."""
    torch.cuda.synchronize(ctx.device)
    dist.barrier()

    def timed() -> None:
        tensors = [torch.empty(count, dtype=dtype, device=ctx.device) for _ in range(ctx.world_size)]
        for r, t in enumerate(tensors):
            fill_pattern(t, r, k)
        run = loopback_call(cfg.op, tensors)
        for _ in range(min(cfg.warmup, 2)):
            run()
        calls = auto_iters(time_round(run, 1, ctx.device), cfg.seconds_per_size / rounds, 1, iters)
        loop_s, copy_s = [], []
        for _ in range(rounds):
            loop_s.append(time_round(run, calls, ctx.device))
            copy_s.append(time_round(copy, calls, ctx.device))
        for r, t in enumerate(tensors):
            fill_pattern(t, r, k)
        run()
        wrong = sum(count_wrong(t, ctx.world_size, k, cfg.op, 0.0) for t in tensors)
        results[RINGREDUCE].update(loopback_us=statistics.median(loop_s) * 1e6,
                                   loopback_copy_us=statistics.median(copy_s) * 1e6)
        results[RINGREDUCE]["wrong"] += wrong
        del tensors
        torch.cuda.synchronize(ctx.device)

    _on_rank0_alone(ctx, timed)


def _on_rank0_alone(ctx: RankContext, work: Callable[[], None]) -> None:
    """Runs `work` on rank 0 while the others wait in the store, not in a collective: a waiting NCCL
    barrier spins a kernel on each GPU, which rank 0's work would time-slice against where ranks share
    a GPU. Collective (each call's key comes from a counter every rank increments once)."""
    store = dist.distributed_c10d._get_default_store()
    generation = (int(store.add(_ALONE_KEY, 1)) - 1) // ctx.world_size
    done = f"{_ALONE_KEY}/{generation}"
    if ctx.rank == 0:
        try:
            work()
        finally:  # a failure on rank 0 ends the run (launch.py stops the others); they must not wait on
            store.set(done, "1")
    else:
        store.wait([done])


def _progress(cfg: BenchConfig, index: int, total: int, size: int, started: float) -> None:
    if cfg.quiet:
        return
    elapsed = time.monotonic() - started
    end = "\r" if sys.stderr.isatty() and index < total else "\n"
    sys.stderr.write(f"ringreduce.bench: {index}/{total} sizes done (last {format_size(size)}B), "
                     f"{elapsed:.1f} s elapsed{' ' * 8}{end}")
    sys.stderr.flush()


def run_sweep(cfg: BenchConfig, ctx: RankContext) -> tuple[list[dict[str, Any]], str] | None:
    """Runs the whole sweep of `cfg` on this rank (`ctx`); rank 0 prints and returns (rows, stock name)."""
    from ringreduce.bench.table import Layout, format_row, header

    impls = build_impls(cfg, ctx.device, DTYPES[cfg.dtype].torch_dtype)
    stock = NCCL if cfg.backend == "nccl" else GLOO
    layout = Layout(tuple(impl.name for impl in impls), stock, loopback=cfg.loopback and ctx.device.type == "cuda",
                    wire=cfg.wire_dtype)
    if ctx.rank == 0:
        print("\n".join(header(layout)), flush=True)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for index, size in enumerate(cfg.sizes, 1):
        mine = measure_size(cfg, ctx, impls, size)
        gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if ctx.rank == 0:
            assert gathered is not None
            size_rows = aggregate_size(size, mine["count"], cfg.dtype, cfg.op, ctx.world_size, gathered)
            rows.extend(size_rows)
            print(format_row(size_rows, layout), flush=True)
            _progress(cfg, index, len(cfg.sizes), size, started)
    impls[0].enter()  # ringreduce's: leaves RINGREDUCE_CHECK as the user had it
    return (rows, stock) if ctx.rank == 0 else None
