"""One rank of the benchmark: join the process group, run the sweep, and (rank 0) write the results."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ringreduce.bench.config import BenchConfig
from ringreduce.bench.gpu_map import nccl_rank_env, nccl_transport_label, rank_device, ranks_share_gpus
from ringreduce.bench.machine import describe
from ringreduce.bench.sizes import DTYPES
from ringreduce.bench.sweep import RankContext, run_sweep

MEMORY_BOUND_BYTES = 12 << 20  # docs/design.md section 5: ringreduce's own memory per CPU group (8 MiB staging + 4 MiB)
PG_TIMEOUT = datetime.timedelta(minutes=10)


def _local_ranks(world_size: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def _init(cfg: BenchConfig) -> RankContext:
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu")
    if cfg.backend == "nccl":
        # Note [Ranks sharing a GPU] (gpu_map.py): rank r on GPU r % GPUs; more ranks than GPUs run
        # over NCCL's socket transport, on one host only.
        gpus = torch.cuda.device_count()
        local_ranks = _local_ranks(world_size)
        if ranks_share_gpus(local_ranks, gpus) and local_ranks != world_size:
            raise SystemExit(f"ringreduce.bench: {local_ranks} ranks per node share {gpus} GPUs; ranks may share "
                             "GPUs on a single node only (Note [Ranks sharing a GPU]): use one rank per GPU")
        os.environ.update(nccl_rank_env(rank, local_ranks, gpus))
        device = torch.device("cuda", rank_device(local_rank, gpus))
        torch.cuda.set_device(device)
    dist.init_process_group(cfg.backend, rank=rank, world_size=world_size, timeout=PG_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    return RankContext(rank=rank, world_size=world_size, device=device)


def _finish(cfg: BenchConfig, rows: list[dict[str, Any]], stock: str, machine: dict[str, Any], elapsed: float) -> int:
    from ringreduce.bench.metrics import add_vs_float
    from ringreduce.bench.report import build_report, write_json
    from ringreduce.bench.table import Layout, footer, memory_lines, table_lines
    from ringreduce.bench.targets import target_lines

    impls = tuple(dict.fromkeys(row["impl"] for row in rows))
    add_vs_float(rows)
    lines: list[str] = []
    for name in cfg.dtypes:  # the sweep printed one type's lines as it went (sweep.run_sweep)
        mine = [row for row in rows if row["type"] == name]
        layout = Layout(impls, stock, loopback=cfg.loopback and cfg.backend == "nccl", wire=cfg.wire_dtype,
                        vs_float=any("vs_float" in row for row in mine))
        if len(cfg.dtypes) > 1:
            lines += ["#", f"# {name} ({DTYPES[name].torch_dtype})"] + table_lines(mine, layout)
        lines += footer(mine, layout)
    layout = Layout(impls, stock, wire=cfg.wire_dtype)
    print("\n".join(lines + memory_lines(rows, layout, MEMORY_BOUND_BYTES)), flush=True)
    if cfg.vs == "deepspeed":
        import deepspeed

        machine = {**machine, "deepspeed": deepspeed.__version__}
    doc = build_report(cfg, machine, rows, stock, elapsed)
    print(target_lines(doc), flush=True)
    if cfg.json_path:
        write_json(doc, cfg.json_path)
        print(f"# JSON written to {cfg.json_path}", flush=True)
    if cfg.plot_path:
        from ringreduce.bench.plot import write_plot

        write_plot(doc, cfg.plot_path)
        print(f"# plot written to {cfg.plot_path}", flush=True)
    return 0 if doc["summary"]["wrong_total"] == 0 else 1


def _banner(cfg: BenchConfig, machine: dict[str, Any]) -> str:
    iters = (f"iters {cfg.iters}" if cfg.iters is not None else
             f"iters auto (~{cfg.seconds_per_size:g} s/size each{', per implementation' if cfg.timing == 'rounds' else ''})")
    check = {None: "default", True: "on", False: "off"}[cfg.check]
    if cfg.timing == "rounds":
        method = (f"timing: {cfg.rounds} rounds of back-to-back calls per implementation ({iters} per round), "
                  "alternating by round; time = round / iters, median over rounds per rank, mean over ranks")
    else:
        method = f"timing: single barrier-aligned calls ({iters}); time = median per rank, mean over ranks"
    return (f"# ringreduce.bench all_reduce: {machine['world_size']} ranks, backend {cfg.backend}, launcher "
            f"{cfg.launcher}, torch threads {machine['torch_threads']}"
            f"\n# {machine['cpu_model']} ({machine['cpu_cores']} cores)"
            + (f", GPUs: {', '.join(machine['gpus'])}" if machine["gpus"] else "")
            + (f"\n# NCCL transport: {machine['transport']}" if machine.get("transport") else "")
            + f"\n# torch {machine['torch']}, NCCL {machine['nccl']}, ringreduce {machine['ringreduce']['version']}"
            + f"\n# warmup {cfg.warmup}, agreement check {check}, transport {cfg.transport}; {method}"
            + "\n# floor = one memcpy of the buffer on each rank, timed the same way; /floor = ringreduce time / floor"
            + "\n#")


def run_rank(cfg: BenchConfig) -> int:
    """Runs this process's rank (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment)."""
    if cfg.transport != "default":
        os.environ["RINGREDUCE_SHM"] = "1" if cfg.transport == "shm" else "0"
    if cfg.pin:  # --pin: local rank r on core r % cores (of the cores this process may use)
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", os.environ["RANK"])) % len(cores)]})
    ctx = _init(cfg)
    try:
        started = time.monotonic()
        hosts: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(hosts, os.uname().nodename)
        transport = (nccl_transport_label(_local_ranks(ctx.world_size), torch.cuda.device_count())
                     if cfg.backend == "nccl" else None)
        machine = describe(cfg.backend, ctx.world_size, [str(h) for h in hosts], transport)
        if ctx.rank == 0:
            print(_banner(cfg, machine), flush=True)
        result = run_sweep(cfg, ctx)
        code = 0
        if result is not None:
            rows, stock = result
            code = _finish(cfg, rows, stock, machine, time.monotonic() - started)
        codes = torch.tensor([code], device=ctx.device)
        dist.all_reduce(codes, op=dist.ReduceOp.MAX)  # ranks leave together; a late rank must not see dead peers
        return int(codes.item())
    finally:
        if cfg.vs == "deepspeed":
            from ringreduce.bench.deepspeed_shm import remove_segment

            remove_segment(ctx.rank)
        dist.destroy_process_group()
