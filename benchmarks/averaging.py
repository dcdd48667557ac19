"""The two averages that the scripts in this folder time, defined once: stock torch.distributed as a
user writes it (all_reduce, then div_: gloo has no AVG) and ringreduce's all_reduce_avg. It imports
whichever ringreduce comes first on the path, so benchmarks/ab_script.sh can time an earlier build."""
import torch
import torch.distributed as dist

import ringreduce as rr


def gloo_average(t: torch.Tensor, world_size: int) -> None:
    dist.all_reduce(t)
    t.div_(world_size)


def ringreduce_average(t: torch.Tensor, world_size: int) -> None:
    rr.all_reduce_avg(t)


def average(impl: str, t: torch.Tensor, world_size: int) -> None:
    """impl "gloo" or "rr" (ringreduce), in place."""
    (gloo_average if impl == "gloo" else ringreduce_average)(t, world_size)
