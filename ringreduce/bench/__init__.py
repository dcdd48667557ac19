"""ringreduce's benchmark: an nccl-tests-style all-reduce sweep against the stock backend.

``python -m ringreduce.bench`` spawns local ranks (or runs under torchrun), sweeps message sizes and
prints, for ringreduce and the stock ``torch.distributed.all_reduce`` (gloo on CPUs; NCCL and NCCL
with ``NCCL_ALGO=RING`` on GPUs), the nccl-tests columns size, count, type, redop, time, algbw,
busbw and #wrong, with the ringreduce/stock time ratio, peak memory per rank, a JSON record and a
PNG plot. ``--mode train`` runs the training-step benchmark (``ringreduce.bench.train_step``).
See benchmarks/README.md for the timing method.
"""

from __future__ import annotations

from ringreduce.bench.cli import main

__all__ = ["main"]
