"""All-reduce sweep: ringreduce vs stock torch.distributed. A thin wrapper over ``python -m ringreduce.bench``.

Usage: python benchmarks/allreduce.py [options]   (see --help; the same options as the package CLI)
"""

from __future__ import annotations

import sys

from ringreduce.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
