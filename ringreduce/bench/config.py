"""The benchmark's settings, shared by the launcher and every rank (picklable)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BenchConfig:
    """What to sweep and how; built by the CLI, sent to every rank."""

    sizes: list[int]  # bytes, already rounded to whole elements
    dtypes: tuple[str, ...]  # nccl-tests names (float, double, half, bfloat16, int8, ...), each swept at every size
    op: str  # "sum" or "avg"
    backend: str  # "gloo" or "nccl" (resolved, never "auto")
    timing: str = "rounds"  # "rounds": nccl-tests' back-to-back rounds; "single": barrier-aligned single calls
    iters: int | None = None  # rounds: calls per round; single: timed calls per implementation; None = auto
    rounds: int = 10  # rounds: timed rounds per implementation and size
    warmup: int = 5
    seconds_per_size: float = 5.0  # auto iters: timed seconds per implementation and size
    min_iters: int = 10
    max_iters: int = 1000
    check: bool | None = None  # ringreduce's agreement check: None = library default
    transport: str = "default"  # ringreduce's CPU transport: "default", "shm" or "tcp" (RINGREDUCE_SHM)
    check_cost: bool = False  # also time ringreduce with RINGREDUCE_CHECK=0
    nccl_ring: bool = True  # on NCCL: also stock NCCL with NCCL_ALGO=RING
    loopback: bool = True  # on NCCL: rank 0 also times the one-GPU loopback driver (Note [Loopback ideal])
    json_path: str | None = None
    plot_path: str | None = None
    command: list[str] = field(default_factory=list)
    launcher: str = "spawn"  # "spawn" (local ranks started by the CLI) or "torchrun"
    quiet: bool = False  # no progress lines on stderr
    wire_dtype: str | None = None  # "bf16"/"fp16": also ringreduce's 16-bit wire and DDP's compress hook
    algorithms: tuple[str, ...] = ()  # also ringreduce with these algorithm= ("ring", "hierarchical", "direct"), a column each
    vs: str | None = None  # "deepspeed": also DeepSpeed's shm all-reduce (bench/deepspeed_shm.py)
    pin: bool = False  # local rank r runs on core r % cores
