"""Training-step benchmark: time per step of a ~25M-parameter model under each way to average
(benchmarks/README.md "Training step"), and ``ddp-backend`` (stock DDP over a group of backend
"ringreduce") and, with ``--wire-dtype``, ``ddp-compress`` (torch's compress hook). ``tail`` starts at a
hook registered before any averaging hook. The averaging variants' final parameters must agree
(PARAM_TOL, WIRE_PARAM_TOL with a 16-bit wire), else the exit code is 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ringreduce.bench.impls import WIRE_DTYPES

VARIANTS = ("local", "ddp", "ddp+hook", "ddp-backend", "averager", "loop-gloo", "loop-rr", "coalesced")
WIRE_VARIANTS = ("ddp-compress",)  # with --wire-dtype only
PARAM_TOL = 1e-5  # max abs difference of the final parameters between averaging variants
WIRE_PARAM_TOL = 1e-3  # the same with a 16-bit wire (partials rounded to 16 bits per hop)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringreduce.bench.train_step",
        description="Time per training step: stock DDP vs DDP+ringreduce hook vs GradientAverager vs the "
        "hand-written all-reduce loop, with the overlap of communication and backward.",
    )
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl with one GPU per rank when enough GPUs, else gloo on CPU")
    p.add_argument("--layers", type=int, default=6, help="Linear layers (default 6)")
    p.add_argument("--width", type=int, default=2048, help="features per layer (default 2048: 6 x 4.2M = 25.2M params)")
    p.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket cap of DDP and GradientAverager")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(VARIANTS + WIRE_VARIANTS)} (default: all; "
                   "ddp-compress needs --wire-dtype)")
    p.add_argument("--wire-dtype", choices=sorted(WIRE_DTYPES), default=None,
                   help="ddp+hook and averager carry float32 gradients as 16-bit partials (ringreduce's wire_dtype); "
                   "adds ddp-compress (torch's bf16/fp16_compress_hook) to the default variants")
    p.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this file")
    return p


def make_model(layers: int, width: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for k in range(layers):
        mods.append(nn.Linear(width, width))
        if k + 1 < layers:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods).to(device)


def batch_for(step: int, rank: int, batch: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    return x.to(device), y.to(device)


def _run_variant(name: str, args: argparse.Namespace, device: torch.device, rank: int, ws: int,
                 ring_group: Any = None) -> dict[str, Any]:
    import ringreduce as rr

    model = make_model(args.layers, args.width, device)
    params = list(model.parameters())
    last_grad = [0.0]  # when the last gradient of the current backward was accumulated

    def grad_ready(_p: torch.Tensor) -> None:
        last_grad[0] = time.perf_counter()

    clock = [p.register_post_accumulate_grad_hook(grad_ready) for p in params]  # before any averaging hook
    trained: nn.Module = model
    averager = None
    if name in ("ddp", "ddp-backend", "ddp+hook", "ddp-compress"):
        group = ring_group if name == "ddp-backend" else None
        trained = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, process_group=group)
    wire = WIRE_DTYPES[args.wire_dtype] if args.wire_dtype else None
    if name == "ddp+hook":
        trained.register_comm_hook(rr.CommHookState(wire_dtype=wire) if wire else None, rr.ddp_comm_hook)
    elif name == "ddp-compress":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.bf16_compress_hook if wire == torch.bfloat16 else default_hooks.fp16_compress_hook
        trained.register_comm_hook(None, hook)
    elif name == "averager":
        averager = rr.GradientAverager(model, bucket_cap_mb=args.bucket_cap_mb, wire_dtype=wire)
    opt = torch.optim.SGD(params, lr=1e-3)
    loss_fn = nn.MSELoss()

    def after_backward() -> None:
        if name == "loop-gloo":
            for p in params:
                dist.all_reduce(p.grad)
                p.grad.div_(ws)
        elif name == "loop-rr":
            for p in params:
                rr.all_reduce_avg(p.grad)
        elif name == "coalesced":
            rr.all_reduce_coalesced([p.grad for p in params], op=rr.ReduceOp.AVG)

    def sync_device() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times, tails = [], []
    for step in range(args.warmup + args.steps):
        x, y = batch_for(step, rank, args.batch, args.width, device)
        sync_device()
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(trained(x), y)
        loss.backward()
        after_backward()
        t_averaged = time.perf_counter()
        opt.step()
        sync_device()
        t1 = time.perf_counter()
        if step < args.warmup:
            continue
        times.append(t1 - t0)
        tails.append(max(0.0, t_averaged - last_grad[0]))
    if averager is not None:
        averager.remove()
    for handle in clock:
        handle.remove()
    result: dict[str, Any] = {
        "variant": name,
        "median_ms": statistics.median(times) * 1e3,
        "min_ms": min(times) * 1e3,
        "final_params": None if name == "local" else torch.cat([p.detach().reshape(-1).cpu() for p in params]),
    }
    if name != "local":
        result["tail_ms"] = statistics.median(tails) * 1e3
    del trained, model, opt
    return result


def _mean_over_ranks(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def run_rank(args: argparse.Namespace) -> int:
    """Runs every variant that `args` names on this rank (group initialized); rank 0 prints."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if args.variants is None:
        names = list(VARIANTS) + (list(WIRE_VARIANTS) if args.wire_dtype else [])
    else:
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS + WIRE_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS + WIRE_VARIANTS)}")
    if "ddp-compress" in names and not args.wire_dtype:
        raise SystemExit("the ddp-compress variant needs --wire-dtype bf16 or fp16")
    tolerance = WIRE_PARAM_TOL if args.wire_dtype else PARAM_TOL
    nparams = sum(p.numel() for p in make_model(args.layers, args.width, torch.device("meta")).parameters())
    ring_group = dist.new_group(backend="ringreduce") if "ddp-backend" in names else None
    rows = []
    for name in names:
        r = _run_variant(name, args, device, rank, ws, ring_group)
        for key in ("median_ms", "min_ms", "tail_ms"):
            if key in r:
                r[key] = _mean_over_ranks(r[key], device)
        rows.append(r)
    local_ms = next((r["median_ms"] for r in rows if r["variant"] == "local"), None)
    ddp_ms = next((r["median_ms"] for r in rows if r["variant"] == "ddp"), None)
    for r in rows:
        r["exposed_ms"] = r["median_ms"] - local_ms if local_ms is not None and r["variant"] != "local" else None
        r["vs_ddp"] = r["median_ms"] / ddp_ms if ddp_ms else None
    finals = [(r, r.pop("final_params")) for r in rows]
    reference = next((final for _, final in finals if final is not None), None)
    for r, final in finals:
        if final is not None:
            r["max_param_diff"] = float((final - reference).abs().max())
    agree = all(r.get("max_param_diff", 0.0) <= tolerance for r in rows)
    agree = _mean_over_ranks(float(agree), device) == 1.0
    if rank == 0:
        _print(rows, args, ws, nparams, device, agree)
        if args.json_path:
            doc = {
                "benchmark": "train_step",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "world_size": ws,
                "backend": dist.get_backend(),
                "device": str(device.type),
                "params": nparams,
                "model": f"{args.layers} x Linear({args.width}, {args.width})",
                "batch_per_rank": args.batch,
                **{key: getattr(args, key) for key in ("steps", "warmup", "bucket_cap_mb", "wire_dtype")},
                "param_tolerance": tolerance,
                "torch_threads": torch.get_num_threads(),
                "results_agree": agree,
                "rows": rows,
                "command": [sys.executable, "-m", "ringreduce.bench.train_step", *args.argv],
            }
            with open(args.json_path, "w") as f:
                json.dump(doc, f, indent=2)
    return 0 if agree else 1


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _print(rows: list[dict[str, Any]], args: argparse.Namespace, ws: int, nparams: int, device: torch.device,
           agree: bool) -> None:
    print(f"# ringreduce train-step benchmark: {args.layers} x Linear({args.width}, {args.width}) = "
          f"{nparams / 1e6:.1f}M params, batch {args.batch}/rank, {ws} ranks, {dist.get_backend()} on "
          f"{device.type}, {torch.get_num_threads()} torch threads/rank, bucket cap {args.bucket_cap_mb} MB"
          + (f", 16-bit wire {args.wire_dtype} (ddp+hook, averager)" if args.wire_dtype else ""))
    print(f"# median of {args.steps} steps after {args.warmup} warm-up steps, averaged over ranks; "
          "exposed = step - local step; tail = last gradient ready -> every gradient averaged")
    head = f"{'variant':>11} {'step ms':>9} {'min ms':>8} {'vs ddp':>7} {'exposed ms':>11} {'tail ms':>8}"
    print(head)
    for r in rows:
        print(f"{r['variant']:>11} {r['median_ms']:9.1f} {r['min_ms']:8.1f} {_fmt(r['vs_ddp'], '7.3f'):>7} "
              f"{_fmt(r['exposed_ms'], '11.1f'):>11} {_fmt(r.get('tail_ms'), '8.1f'):>8}")
    diffs = [r["max_param_diff"] for r in rows if r.get("max_param_diff") is not None]
    print(f"# final parameters of the averaging variants {'agree' if agree else 'DISAGREE'} "
          f"(max abs difference {max(diffs, default=0.0):.2e})")


def _in_group(args: argparse.Namespace) -> int:
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=600))
    try:
        return run_rank(args)
    finally:
        dist.destroy_process_group()


def _resolve_backend(requested: str, nproc: int) -> str:
    """The backend for `nproc` local ranks: "auto" is NCCL with a GPU per rank, else gloo. NCCL runs one
    rank per GPU here (run_rank uses cuda:LOCAL_RANK): fewer GPUs than local ranks is refused."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "nccl" and gpus < nproc:
        fix = f"--nproc {gpus}" if gpus >= 2 else "--backend gloo"
        raise SystemExit(f"ringreduce.bench.train_step: --backend nccl runs one rank per GPU, but {nproc} local ranks "
                         f"meet {gpus} visible GPU(s); use {fix} (the all-reduce sweep, python -m ringreduce.bench "
                         "--backend nccl, runs ranks that share a GPU)")
    if requested != "auto":
        return requested
    return "nccl" if gpus >= nproc else "gloo"


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark (spawning local ranks unless under torchrun); returns the exit code."""
    from ringreduce.bench.launch import spawn, under_launcher

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if under_launcher():
        args.backend = _resolve_backend(args.backend, int(os.environ["LOCAL_WORLD_SIZE"])
                                        if "LOCAL_WORLD_SIZE" in os.environ else 1)
        return _in_group(args)
    args.backend = _resolve_backend(args.backend, args.nproc)
    return spawn(_in_group, args, args.nproc, "ringreduce.bench.train_step")


if __name__ == "__main__":
    sys.exit(main())
