"""Run by tests/test_trainers.py under `torchrun --nproc-per-node 2`: runs one of docs/trainers.md's
programs (extracted to a file) once per backend named on the command line, in these processes (the
trainers' imports cost more than their training), and prints after each run how many collectives
went through ringreduce's ring in it:

    python -m torch.distributed.run --nproc-per-node 2 trainer_runner.py PROGRAM.py ringreduce gloo
"""

from __future__ import annotations

import runpy
import sys

import torch.distributed as dist

from ringreduce.distributed.process_group import RingreduceProcessGroup


def main() -> int:
    program, backends = sys.argv[1], sys.argv[2:]
    ring_calls = 0
    counted = RingreduceProcessGroup._ring_call

    def counting(self, name):
        nonlocal ring_calls
        ring_calls += 1
        return counted(self, name)

    RingreduceProcessGroup._ring_call = counting
    for backend in backends:
        ring_calls = 0
        sys.argv = [program, backend]
        runpy.run_path(program, run_name="__main__")
        rank = dist.get_rank() if dist.is_initialized() else -1
        print(f"rank {rank}: {backend} run: {ring_calls} ring calls", flush=True)
        if dist.is_initialized():  # the next run creates its own group
            dist.destroy_process_group()
        if "accelerate" in sys.modules:  # Accelerate keeps its state process-wide
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state(reset_partial_state=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
