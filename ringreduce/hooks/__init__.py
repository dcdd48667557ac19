"""Gradient averaging overlapped with backward (GradientAverager: buckets.py, averager.py) and the DDP
communication hook (ddp_hook.py)."""

from ringreduce.hooks.averager import GradientAverager
from ringreduce.hooks.ddp_hook import CommHookState, ddp_comm_hook

__all__ = ["CommHookState", "GradientAverager", "ddp_comm_hook"]
