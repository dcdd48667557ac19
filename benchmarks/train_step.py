"""Training-step benchmark: DDP vs DDP + ringreduce hook vs GradientAverager vs the hand-written loop.

A thin wrapper over ``python -m ringreduce.bench.train_step`` (see --help; the same options).
Usage: python benchmarks/train_step.py [--steps 20] [--json out.json]
"""

from __future__ import annotations

import sys

from ringreduce.bench.train_step import main

if __name__ == "__main__":
    sys.exit(main())
