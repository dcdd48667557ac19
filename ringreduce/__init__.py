"""ringreduce: gradient averaging with its own pipelined ring all-reduce.

NCCL send/recv with ringreduce's CUDA kernels on GPUs, torch.distributed point-to-point (gloo) on
CPUs. See README.md and docs/algorithm.md.
"""

from __future__ import annotations

import atexit

import torch

from ringreduce import (
    _call,
    _config,
    _groups,
    _library,  # noqa: F401 - registers the ringreduce:: custom ops (torch.compile)
    _rings,
    functional,  # the out-of-place collectives (ringreduce.functional.all_reduce, ...)
    nn,  # noqa: E402 - the autograd-aware collectives (ringreduce.nn.all_gather, ...)
)
from ringreduce._native import C as _C
from ringreduce._types import UnsupportedOpError
from ringreduce.coalesced import all_reduce_coalesced
from ringreduce.distributed import BackendOptions
from ringreduce.distributed import register as _register_backend
from ringreduce.hooks import CommHookState, GradientAverager, ddp_comm_hook
from ringreduce.ops import ReduceOp, all_reduce, all_reduce_avg
from ringreduce.scatter_gather import all_gather, reduce_scatter
from ringreduce.work import Work

__version__ = _C.native_info["version"]


def build_info() -> dict:
    """What this installation was built with.

    Keys: version, cuda (bool: CUDA+NCCL compiled in), nccl_version (NCCL headers compiled
    against, "x.y.z" or None), nccl_runtime_version (the libnccl loaded now, or None), cuda_archs
    (list of compute capabilities), torch (the running torch), torch_built (the torch it was built
    against), shm (the shared-memory transport of CPU rings on one host is built in).
    """
    info = {
        "version": __version__,
        "cuda": bool(_C.native_info["cuda"]),
        "nccl_version": None,
        "nccl_runtime_version": None,
        "cuda_archs": [],
        "torch": torch.__version__,
        "torch_built": _C.native_info["torch_built"],
        "shm": bool(_C.native_info.get("shm", False)),
    }
    if info["cuda"] and hasattr(_C, "cuda_build_info"):
        info.update(_C.cuda_build_info())
    return info




def reload_knobs() -> None:
    """Reads the RINGREDUCE_* environment variables again (README's Knobs table): every ring takes the
    new values at its next call.

    ringreduce reads its knobs when a ring is made (a process group's first ringreduce call on a
    device), as NCCL and c10d read theirs when a communicator or a group is made; a later change of
    os.environ reaches the rings that exist only through this call (a new group reads them anyway).

    Raises:
        ValueError: a knob has a value it does not take (the message names it); nothing changes then.
    """
    _config.reload()


def _forget_at_exit() -> None:
    """Drops the plans, rings and cached GroupInfos, which hold their process groups (see below)."""
    _call.forget_plans()
    _rings.forget_all()
    _groups.forget_ring()


_register_backend()  # the torch.distributed backend "ringreduce" (ringreduce/distributed/)

atexit.register(_C.shutdown)
# atexit runs handlers last-in first-out: the cached GroupInfos (which hold their process groups)
# are dropped first, so that the runtimes' references, released by _C.shutdown without the GIL, are
# the last ones. A process group destroyed later, while the interpreter is finalizing, can abort
# the process: gloo's threads may then need the GIL to release their tensors.
atexit.register(_forget_at_exit)

__all__ = [
    "BackendOptions",
    "CommHookState",
    "GradientAverager",
    "ReduceOp",
    "UnsupportedOpError",
    "Work",
    "all_reduce",
    "all_reduce_avg",
    "all_reduce_coalesced",
    "all_gather",
    "nn",
    "reduce_scatter",
    "reload_knobs",
    "build_info",
    "functional",
    "ddp_comm_hook",
]
