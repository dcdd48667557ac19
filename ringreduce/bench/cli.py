"""Command line of ``python -m ringreduce.bench``: parse, pick backend and ranks, launch."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.sizes import DTYPES, parse_dtypes, parse_size, size_sweep

DEFAULT_BEGIN = "1K"
DEFAULT_END = "64M"
DEFAULT_FACTOR = 4.0
DEFAULT_SECONDS = 6.0

_EPILOG = f"""\
defaults: -b {DEFAULT_BEGIN} -e {DEFAULT_END} -f {DEFAULT_FACTOR:g} -d float -o avg -w 5 --timing rounds --rounds 10,
calls per round chosen per size so each implementation runs about {DEFAULT_SECONDS:g} s (10..1000 calls per round).
Sizes take binary units (K = 1024, as nccl-tests).

timing (as nccl-tests): each round runs its calls back to back and is timed as a whole; time (us) =
round time / calls, the median over rounds on each rank, averaged over ranks (the slowest rank's is
in the JSON); implementations alternate by round, with an untimed barrier before each.
--timing single times barrier-aligned single calls instead. algbw = bytes / time; busbw = algbw *
2(n-1)/n; #wrong counts wrong elements after one extra call on exact data, summed over ranks;
ratio = ringreduce time / stock time; floor = one memcpy of the buffer, timed the same way.
On GPUs (--backend nccl): nccl-ring = stock NCCL with NCCL_ALGO=RING, %ring = ringreduce busbw / its busbw;
loop(us) = the one-GPU loopback driver (world-size simulated ranks on rank 0's GPU), loop-eff = its
HBM-traffic time at the copy's rate (7(n-1)/2 copies of the buffer) / its time.

examples:
  python -m ringreduce.bench                                   # 2 CPU ranks or all GPUs
  python -m ringreduce.bench -b 1M -e 64M -f 4 --nproc 4       # 4 ranks, 1 to 64 MiB
  python -m ringreduce.bench --backend nccl --nproc 2 -b 1M -e 256M -f 2   # one GPU: 2 ranks share it
  python -m ringreduce.bench -b 8 -e 1M -f 4 --check-cost      # cost of the agreement check
  python -m ringreduce.bench -b 16M -e 64M --wire-dtype bf16    # 16-bit wire vs float32 and DDP's hook
  python -m ringreduce.bench -o sum --vs deepspeed --pin        # against DeepSpeed's shm all-reduce
  torchrun --nnodes 2 --nproc-per-node 8 ... -m ringreduce.bench -b 8 -e 256M -f 2
  python -m ringreduce.bench --mode train [train-step options]  # training-step benchmark
"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also documents the defaults in --help)."""
    p = argparse.ArgumentParser(
        prog="python -m ringreduce.bench",
        description="nccl-tests-style all-reduce sweep: ringreduce against stock torch.distributed "
        "(gloo on CPUs; NCCL and NCCL_ALGO=RING on GPUs).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--mode", choices=("allreduce", "train"), default="allreduce",
                   help="allreduce sweep (default) or the training-step benchmark (other args go to it)")
    sizes = p.add_argument_group("sizes")
    sizes.add_argument("-b", "--minbytes", default=DEFAULT_BEGIN, help=f"first size (default {DEFAULT_BEGIN})")
    sizes.add_argument("-e", "--maxbytes", default=DEFAULT_END, help=f"last size (default {DEFAULT_END})")
    step = sizes.add_mutually_exclusive_group()
    step.add_argument("-f", "--stepfactor", type=float, default=None,
                      help=f"multiply the size by this (default {DEFAULT_FACTOR:g})")
    step.add_argument("-i", "--stepbytes", default=None, help="add this many bytes instead of multiplying")
    run = p.add_argument_group("what and how long")
    run.add_argument("-d", "--dtype", default="float",
                     help=f"element type, or several comma-separated (-d float,bfloat16,half: every size times each, "
                     f"alternating by round, one table per type): {', '.join(DTYPES)} (default float)")
    run.add_argument("-o", "--op", choices=("sum", "avg"), default="avg",
                     help="avg: ringreduce.all_reduce_avg vs all_reduce+div_ (gloo) / ReduceOp.AVG (NCCL); "
                     "sum: all_reduce SUM (default avg)")
    run.add_argument("--timing", choices=("rounds", "single"), default="rounds",
                     help="rounds: back-to-back calls timed together, as nccl-tests (default); single: "
                     "barrier-aligned single calls")
    run.add_argument("--rounds", type=int, default=10, help="timed rounds per implementation and size (default 10)")
    run.add_argument("-n", "--iters", type=int, default=None,
                     help="calls per round (single timing: timed calls) per implementation and size "
                     "(default: auto, see --seconds)")
    run.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls per implementation and size (default 5)")
    run.add_argument("--seconds", type=float, default=DEFAULT_SECONDS,
                     help=f"auto iterations: timed seconds per implementation and size (default {DEFAULT_SECONDS:g})")
    run.add_argument("--min-iters", type=int, default=10, help="auto iterations: at least this many (default 10)")
    run.add_argument("--max-iters", type=int, default=1000, help="auto iterations: at most this many (default 1000)")
    run.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                     help="ringreduce's cross-rank agreement check on/off (default: the library's: on for CPU, "
                     "off for GPU; RINGREDUCE_CHECK)")
    run.add_argument("--transport", choices=("default", "shm", "tcp"), default="default",
                     help="ringreduce's CPU transport: shared memory or gloo point-to-point (RINGREDUCE_SHM=1/0); "
                     "default: the library's choice")
    run.add_argument("--check-cost", action="store_true",
                     help="also time ringreduce with RINGREDUCE_CHECK=0, interleaved; adds a check(us) column")
    run.add_argument("--wire-dtype", choices=("bf16", "fp16"), default=None,
                     help="also time ringreduce with this 16-bit wire (rr-bf16) and DDP's bf16/fp16_compress_hook "
                     "(ddp-bf16) in the same run, with their time over ringreduce's float32 time (wire/f32) and "
                     "relative errors against float64 on random data (err-f32, err-wire, err-ddp); float only")
    run.add_argument("--algorithms", default="", metavar="LIST",
                     help="also time ringreduce with each algorithm= of LIST (ring,hierarchical,direct): columns "
                     "rr-ring, rr-hier, rr-direct and their time over the stock one's (ring/gloo, hier/gloo, "
                     "direct/gloo); with direct also direct/ring and, on random data, the relative errors against "
                     "float64 (err-ring, err-direct) and the elements off the correctly rounded result where the "
                     "float32 sum is exact (off-ring, off-direct); with --wire-dtype also rr-direct-bf16, its time "
                     "over rr-bf16's (dwire/wire) and its error (err-dwire)")
    run.add_argument("--vs", choices=("deepspeed",), default=None,
                     help="also time DeepSpeed's CPU shared-memory all-reduce (inference_all_reduce) in the same run, "
                     "with rr/ds, its fallback calls (ds-fb) and accuracy on random data (err-*, off-*: elements "
                     "off the float64 sum rounded once); needs pip install deepspeed")
    run.add_argument("--no-nccl-ring", dest="nccl_ring", action="store_false",
                     help="on GPUs, skip stock NCCL with NCCL_ALGO=RING")
    run.add_argument("--no-loopback", dest="loopback", action="store_false",
                     help="on GPUs, skip timing the one-GPU loopback driver against its HBM ideal (loop columns)")
    ranks = p.add_argument_group("ranks")
    ranks.add_argument("--nproc", type=int, default=None,
                       help="local ranks to spawn (default: all GPUs if >= 2, else 2 CPU ranks; with --backend "
                       "nccl on one GPU 2 ranks); rank r uses GPU r %% GPUs, and ranks sharing a GPU talk over "
                       "NCCL's socket transport on lo (labelled so); ignored under torchrun")
    ranks.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                       help="auto: nccl with >= 2 GPUs and a CUDA build of ringreduce, else gloo")
    ranks.add_argument("--pin", action="store_true", help="pin local rank r to core r %% cores (sched_setaffinity)")
    out = p.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="write every row and the machine to FILE")
    out.add_argument("--plot", dest="plot_path", default=None, help="write busbw vs size to FILE.png")
    out.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    return p


def _resolve_backend(requested: str, launched: bool) -> str:
    import torch

    import ringreduce

    cuda_build = bool(ringreduce.build_info()["cuda"])
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        enough = gpus >= 1 if launched else gpus >= 2
        return "nccl" if enough and cuda_build else "gloo"
    if requested == "nccl" and (gpus == 0 or not cuda_build):
        raise SystemExit("ringreduce.bench: --backend nccl needs CUDA GPUs and a CUDA build of ringreduce "
                         f"(GPUs visible: {gpus}, ringreduce CUDA build: {cuda_build})")
    return requested


def make_config(args: argparse.Namespace, argv: list[str], backend: str, launcher: str) -> BenchConfig:
    """Validates `args` (parsed from `argv`) into the ranks' BenchConfig for `backend` and `launcher`."""
    try:
        dtypes = parse_dtypes(args.dtype)
    except ValueError as e:
        raise SystemExit(f"ringreduce.bench: {e}") from None
    names = ",".join(d.name for d in dtypes)
    for dtype in dtypes:
        if args.op == "avg" and not dtype.torch_dtype.is_floating_point:
            raise SystemExit(f"ringreduce.bench: --op avg needs a floating type, not {dtype.name} (use --op sum)")
    if args.wire_dtype is not None and names != "float":
        raise SystemExit(f"ringreduce.bench: --wire-dtype applies to float32 tensors alone (-d float), not -d {names}")
    if args.vs is not None and len(dtypes) > 1:
        raise SystemExit(f"ringreduce.bench: --vs {args.vs} runs one element type per sweep (its column takes over "
                         f"torch.distributed.all_reduce once per process), not -d {names}: run one -d at a time")
    if args.check is False and args.check_cost:
        raise SystemExit("ringreduce.bench: --check-cost compares check on and off; drop --no-check")
    if args.iters is not None and args.iters < 1:
        raise SystemExit("ringreduce.bench: --iters must be >= 1")
    if args.warmup < 0:
        raise SystemExit("ringreduce.bench: --warmup must be >= 0")
    if args.rounds < 1:
        raise SystemExit("ringreduce.bench: --rounds must be >= 1")
    if args.plot_path is not None and not _has_matplotlib():
        raise SystemExit("ringreduce.bench: --plot needs matplotlib, which this Python lacks (pip install matplotlib); "
                         "drop --plot to run the sweep without the PNG (--json keeps every figure)")
    if args.transport == "shm" and not _has_shm():
        raise SystemExit("ringreduce.bench: --transport shm, but this ringreduce build has no shared-memory "
                         "transport (ringreduce.build_info()['shm'] is missing or False)")
    algorithms = tuple(dict.fromkeys(a.strip() for a in args.algorithms.split(",") if a.strip()))
    if any(a not in ("ring", "hierarchical", "direct") for a in algorithms):
        raise SystemExit(f"ringreduce.bench: --algorithms takes ring, hierarchical and/or direct, got {args.algorithms!r}")
    if args.vs == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            raise SystemExit("ringreduce.bench: --vs deepspeed needs DeepSpeed, which this Python lacks: pip install "
                             "deepspeed (an optional benchmark dependency; DS_ACCELERATOR=cpu is set by the bench)")
        if backend != "gloo":
            raise SystemExit("ringreduce.bench: --vs deepspeed compares CPU shared memory; use --backend gloo")
    increment = parse_size(args.stepbytes) if args.stepbytes is not None else None
    factor = None if increment is not None else (args.stepfactor or DEFAULT_FACTOR)
    # Every type gets the same bytes at a size: whole elements of the widest.
    sizes = size_sweep(parse_size(args.minbytes), parse_size(args.maxbytes), factor, increment,
                       max(d.torch_dtype.itemsize for d in dtypes))
    if not sizes:
        raise SystemExit("ringreduce.bench: no size in the range holds a whole element")
    return BenchConfig(
        sizes=sizes, dtypes=tuple(d.name for d in dtypes), op=args.op, backend=backend, timing=args.timing, rounds=args.rounds,
        iters=args.iters, warmup=args.warmup, transport=args.transport,
        seconds_per_size=args.seconds, min_iters=args.min_iters, max_iters=args.max_iters,
        check=True if args.check_cost and backend == "nccl" and args.check is None else args.check,
        check_cost=args.check_cost, nccl_ring=args.nccl_ring, loopback=args.loopback, json_path=args.json_path,
        plot_path=args.plot_path, command=[sys.executable, "-m", "ringreduce.bench", *argv], launcher=launcher,
        quiet=args.quiet, wire_dtype=args.wire_dtype, algorithms=algorithms, vs=args.vs, pin=args.pin,
    )


def _has_matplotlib() -> bool:
    """Whether --plot can draw (checked before the sweep: a missing module must not cost the run)."""
    return importlib.util.find_spec("matplotlib") is not None


def _has_shm() -> bool:
    import ringreduce

    return bool(ringreduce.build_info().get("shm", False))


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the exit code (1 if any result was wrong)."""
    from ringreduce.bench.launch import spawn, under_launcher
    from ringreduce.bench.rank_main import run_rank

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--mode", default="allreduce")
    known, rest = pre.parse_known_args(argv)
    if known.mode == "train":
        from ringreduce.bench.train_step import main as train_main

        return train_main(rest)
    args = build_parser().parse_args(argv)
    launched = under_launcher()
    backend = _resolve_backend(args.backend, launched)
    cfg = make_config(args, argv, backend, "torchrun" if launched else "spawn")
    if launched:
        if args.nproc is not None:
            sys.stderr.write("ringreduce.bench: --nproc is ignored under torchrun (the launcher sets the ranks)\n")
        return run_rank(cfg)
    import torch

    # More ranks than GPUs share them over NCCL's socket transport (Note [Ranks sharing a GPU], gpu_map.py).
    nproc = args.nproc if args.nproc is not None else (max(2, torch.cuda.device_count()) if backend == "nccl" else 2)
    if nproc < 2:
        raise SystemExit("ringreduce.bench: --nproc must be >= 2")
    if cfg.vs is None or "TORCH_EXTENSIONS_DIR" in os.environ:
        return spawn(run_rank, cfg, nproc, "ringreduce.bench")
    # DeepSpeed JIT-builds its shm op: into a folder of this run, removed afterwards.
    with tempfile.TemporaryDirectory(prefix="rr_bench_ds_") as ext:
        os.environ["TORCH_EXTENSIONS_DIR"] = ext
        try:
            return spawn(run_rank, cfg, nproc, "ringreduce.bench")
        finally:
            del os.environ["TORCH_EXTENSIONS_DIR"]
