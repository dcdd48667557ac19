"""ringreduce's benchmark (``python -m ringreduce.bench``): an nccl-tests-style all-reduce sweep against
the stock backend; ``--mode train`` runs ``ringreduce.bench.train_step``. See benchmarks/README.md.
"""

from __future__ import annotations

from ringreduce.bench.cli import main

__all__ = ["main"]
