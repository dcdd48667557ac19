"""What every rank runs: for each size, memory probe, warm-up, timed rounds, the memcpy floor and
correctness (the method: benchmarks/README.md "Timing method"); rank 0 gathers, and prints as it goes
when the sweep has one element type.

Note [Several element types in one sweep]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``-d float,bfloat16,...`` every size runs every (element type, implementation) pair, a Column,
in the same rounds, alternating as the implementations of one type do (the order reversed every other
round); every type's tensor has the size's bytes. A ratio between types (bfloat16 over float32 at the
same bytes) is then as fair as one between implementations. The rows of each type form its own table,
printed after the sweep (rank_main.py).

Note [Calls per round]
~~~~~~~~~~~~~~~~~~~~~~
With ``-n`` unset, every column gets its own calls per round: its slowest warm-up median over the
ranks divided into its share of ``--seconds``, so that each spends about that long in its rounds
whatever the others cost. One count for all, from the slowest column (gloo takes 10-200x ringreduce's
time on CPUs), gave ringreduce rounds of a few hundred microseconds at small sizes, where the ranks'
skew out of the untimed barrier before each round and one scheduler tick weigh as much as the calls,
and moved its small-size times 5x between runs. ``-n N`` still fixes every column's count.
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


def _agree_max(values: list[float], device: torch.device) -> list[float]:
    """Each of `values`' maximum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


@dataclass(frozen=True)
class Column:
    """One implementation on one element type in a size's rounds (Note [Several element types in one sweep])."""

    dtype: str  # nccl-tests name
    impl: Impl

    @property
    def key(self) -> str:
        return f"{self.dtype}/{self.impl.name}"


def _interleaved(columns: list[Column], round_index: int) -> list[Column]:
    return columns if round_index % 2 == 0 else columns[::-1]


def _single_calls(columns: list[Column], calls: dict[str, Callable[[], None]], n: int,
                  device: torch.device) -> dict[str, list[float]]:
    """Seconds of each call of `n` rounds of one call per column, alternating (A B B A ...). Where the
    column changes, its implementation's environment is applied after an untimed barrier; on GPUs the
    previous calls' device work finishes first (the barrier orders host threads only)."""
    timers = {col.key: CallTimer(device) for col in columns}
    previous = None
    for i in range(n):
        for col in _interleaved(columns, i):
            if col is not previous:
                if previous is not None and device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
            col.impl.enter()
            previous = col
            timers[col.key].time(calls[col.key])
    return {key: timer.seconds() for key, timer in timers.items()}


def calls_per_round(cfg: BenchConfig, estimates: list[float]) -> list[int]:
    """The calls per round (single timing: timed calls) of columns whose one call takes `estimates`
    seconds (the slowest rank's), under `cfg` (Note [Calls per round]): `-n` for all; in rounds, each
    column's own count for its share of `--seconds`; single calls alternate one call per column, so
    one count for all, from the slowest."""
    if cfg.iters is not None:
        return [cfg.iters] * len(estimates)
    if cfg.timing == "rounds":
        return [auto_iters(est, cfg.seconds_per_size / cfg.rounds, cfg.min_iters, cfg.max_iters) for est in estimates]
    return [auto_iters(max(estimates), cfg.seconds_per_size, cfg.min_iters, cfg.max_iters)] * len(estimates)


def measure_size(cfg: BenchConfig, ctx: RankContext, columns: list[Column], size: int) -> dict[str, Any]:
    """This rank's (`ctx`) measurements of `columns` at `size` bytes under `cfg`: per element type, its
    count and each implementation's figures ({"dtypes": {name: {"count", "impls": {impl: ...}}}, ...})."""
    dtypes = {col.dtype: DTYPES[col.dtype].torch_dtype for col in columns}
    counts = {name: size // dtype.itemsize for name, dtype in dtypes.items()}
    moduli = {name: pattern_modulus(dtype, ctx.world_size) for name, dtype in dtypes.items()}
    bufs = {col.key: torch.empty(counts[col.dtype], dtype=dtypes[col.dtype], device=ctx.device) for col in columns}
    calls = {col.key: (lambda col=col: col.impl.run(bufs[col.key])) for col in columns}
    for col in columns:
        fill_pattern(bufs[col.key], ctx.rank, moduli[col.dtype])
    results: dict[str, dict[str, Any]] = {}
    probe_s = {}
    for col in columns:
        col.impl.enter()
        t0 = time.perf_counter()
        results[col.key] = asdict(measure_call(calls[col.key], ctx.device))
        probe_s[col.key] = time.perf_counter() - t0

    warm = _single_calls(columns, calls, cfg.warmup, ctx.device)
    estimates = [statistics.median(warm[c.key]) if cfg.warmup else probe_s[c.key] for c in columns]
    rounds = cfg.rounds if cfg.timing == "rounds" else 1
    col_iters = dict(zip((col.key for col in columns), calls_per_round(cfg, _agree_max(estimates, ctx.device)), strict=True))
    iters = max(col_iters.values())

    source = bufs[columns[0].key]  # the size's bytes, whatever the type
    floor = torch.empty_like(source)
    per_call: dict[str, list[float]] = {col.key: [] for col in columns}
    floor_s: list[float] = []
    if cfg.timing == "rounds":
        for r in range(rounds):
            for col in _interleaved(columns, r):
                if ctx.device.type == "cuda":
                    torch.cuda.synchronize(ctx.device)
                dist.barrier()  # untimed: every rank starts the round together
                col.impl.enter()
                per_call[col.key].append(time_round(calls[col.key], col_iters[col.key], ctx.device))
            floor_s.append(time_round(lambda: floor.copy_(source), iters, ctx.device))
    else:
        per_call = _single_calls(columns, calls, iters, ctx.device)
        floor_s.append(time_round(lambda: floor.copy_(source), iters, ctx.device))
    for col in columns:
        results[col.key].update(summarize(per_call[col.key]))
        results[col.key]["floor_us"] = statistics.median(floor_s) * 1e6
        results[col.key]["iters"] = col_iters[col.key]

    for col in columns:
        buf = bufs[col.key]
        fill_pattern(buf, ctx.rank, moduli[col.dtype])
        col.impl.enter()
        col.impl.run(buf)
        results[col.key]["wrong"] = count_wrong(buf, ctx.world_size, moduli[col.dtype], cfg.op, col.impl.rtol)
    by_dtype: dict[str, dict[str, Any]] = {}
    for name, dtype in dtypes.items():
        mine = [col for col in columns if col.dtype == name]
        impl_results = {col.impl.name: results[col.key] for col in mine}
        if cfg.loopback and ctx.device.type == "cuda":
            _time_loopback(cfg, ctx, counts[name], dtype, moduli[name], iters, rounds, lambda: floor.copy_(source),
                           impl_results)
        direct = "direct" in cfg.algorithms
        if cfg.wire_dtype is not None or cfg.vs is not None or direct:
            from ringreduce.bench.accuracy import accuracy

            # --vs: every implementation's error and elements off; --wire-dtype: the float32 and wire errors;
            # --algorithms direct: the ring's and direct's errors and elements off.
            impls = [col.impl for col in mine]
            compared = impls if cfg.vs else [i for i in impls if i.name in _accuracy_names(cfg)]
            for impl_name, value in accuracy(compared, cfg.op, counts[name], ctx.rank, ctx.world_size, dtype,
                                             ctx.device).items():
                impl_results[impl_name].update(value if cfg.vs or direct else {"rel_error": value["rel_error"]})
        for col in mine:
            if col.impl.column is not None:  # --vs deepspeed, untimed: the ops one call ran, its calls and fallbacks
                impl_results[col.impl.name]["profiled_ops"] = col.impl.column.profiled_ops(bufs[col.key])
                impl_results[col.impl.name]["calls"], impl_results[col.impl.name]["fallback_calls"] = (
                    col.impl.column.counts())
        by_dtype[name] = {"count": counts[name], "impls": impl_results}
    return {"size": size, "iters": iters, "rounds": rounds, "warmup": cfg.warmup, "dtypes": by_dtype}


def _accuracy_names(cfg: BenchConfig) -> set[str]:
    """The implementations whose accuracy a sweep without --vs reports: ringreduce, its 16-bit wire and
    DDP's hook (--wire-dtype), the ring and direct (--algorithms direct, with the wire: direct's too)."""
    names = {RINGREDUCE}
    if cfg.wire_dtype is not None:
        names.update(wire_names(cfg.wire_dtype))
    if "direct" in cfg.algorithms:
        names.update((ALGORITHM_NAMES["ring"], ALGORITHM_NAMES["direct"]))
        if cfg.wire_dtype is not None:
            names.add(direct_wire_name(cfg.wire_dtype))
    return names


def _time_loopback(cfg: BenchConfig, ctx: RankContext, count: int, dtype: torch.dtype, k: int, iters: int,
                   rounds: int, copy: Callable[[], Any], results: dict[str, dict[str, Any]]) -> None:
    """Rank 0 times the one-GPU loopback driver over world_size simulated ranks, alone on its GPU, and
    `copy` (one copy of the buffer) in the same rounds (Note [Loopback ideal] in metrics.py); it is
    checked too."""
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
    """Runs the whole sweep of `cfg` on this rank (`ctx`); rank 0 returns (rows, stock name), and prints
    each size's line as it goes when the sweep has one element type (Note [Several element types in one sweep])."""
    from ringreduce.bench.table import Layout, format_row, header

    columns = [Column(name, impl) for name in cfg.dtypes
               for impl in build_impls(cfg, ctx.device, DTYPES[name].torch_dtype)]
    stock = NCCL if cfg.backend == "nccl" else GLOO
    live = len(cfg.dtypes) == 1
    layout = Layout(tuple(col.impl.name for col in columns if col.dtype == cfg.dtypes[0]), stock,
                    loopback=cfg.loopback and ctx.device.type == "cuda", wire=cfg.wire_dtype)
    if ctx.rank == 0:
        if live:
            print("\n".join(header(layout)), flush=True)
        else:
            print(f"# element types {', '.join(cfg.dtypes)}: each size times every type's implementations in the same "
                  "rounds; one table per type after the sweep", flush=True)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for index, size in enumerate(cfg.sizes, 1):
        mine = measure_size(cfg, ctx, columns, size)
        gathered: list[Any] | None = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if ctx.rank == 0:
            assert gathered is not None
            for name in cfg.dtypes:
                per_rank = [{**{key: g[key] for key in ("iters", "rounds", "warmup")}, "impls": g["dtypes"][name]["impls"]}
                            for g in gathered]
                size_rows = aggregate_size(size, mine["dtypes"][name]["count"], name, cfg.op, ctx.world_size, per_rank)
                rows.extend(size_rows)
                if live:
                    print(format_row(size_rows, layout), flush=True)
            _progress(cfg, index, len(cfg.sizes), size, started)
    columns[0].impl.enter()  # ringreduce's: leaves RINGREDUCE_CHECK as the user had it
    return (rows, stock) if ctx.rank == 0 else None
