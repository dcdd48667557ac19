"""Entry point of ``python -m ringreduce.bench``."""

from __future__ import annotations

import sys

from ringreduce.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
