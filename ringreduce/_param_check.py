"""GradientAverager's construction-time check that every rank averages the same parameters.

Note [Same parameters on every rank]
    Buckets pair rank A's k-th gradient element with rank B's k-th, so every rank must hold the same
    parameters in the same order, shapes and dtypes; otherwise the first backward would fail with an
    agreement error that names no parameter, or silently mix gradients. At construction each rank
    all-reduces [count, hash, -count, -hash] (a 56-bit hash of the shapes and dtypes) with MAX: equal
    digests everywhere leave them unchanged, anything else is seen on every rank alike. Only then a
    MAX all-reduce of per-parameter hashes finds the first difference, and an all-gather of a text per
    rank names it, so every rank raises the same ValueError (as DDP checks at construction).
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ringreduce import ops, scatter_gather  # as modules: a test counts the calls through their attributes
from ringreduce._groups import resolve
from ringreduce._types import ReduceOp

_TEXT_BYTES = 192  # one rank's description of one parameter in the detail's all-gather
_HASH_MASK = (1 << 56) - 1


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _HASH_MASK


def check_same_parameters(tensors: list[torch.Tensor], names: list[str], group: Any, who: str) -> None:
    """Raises ValueError on every rank of `group` when the ranks' `tensors` (the bucketed tensors, in
    order; `names` for messages) differ in count, shape or dtype (Note [Same parameters on every
    rank]). Every rank of the group must call it; one collective when they agree."""
    device = tensors[0].device if tensors else torch.device("cpu")
    texts = [f"shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}" for t in tensors]
    hashes = [_hash(text) for text in texts]
    whole = _hash("|".join(texts))
    digest = torch.tensor([len(tensors), whole, -len(tensors), -whole], dtype=torch.int64, device=device)
    ops.all_reduce(digest, op=ReduceOp.MAX, group=group)
    most, least = digest[:2].tolist(), [-v for v in digest[2:].tolist()]
    if most == least:
        return
    counts = (least[0], most[0])
    per = torch.full((2 * counts[1],), -1, dtype=torch.int64, device=device)
    per[: len(hashes)] = torch.tensor(hashes, dtype=torch.int64)
    per[counts[1]: counts[1] + len(hashes)] = -torch.tensor(hashes, dtype=torch.int64)
    per[counts[1] + len(hashes):] = 1  # absent: -1 as a hash, +1 as its negation (hashes are >= 0)
    ops.all_reduce(per, op=ReduceOp.MAX, group=group)
    high, low = per[: counts[1]].tolist(), [-v for v in per[counts[1]:].tolist()]
    first = next((i for i in range(counts[1]) if high[i] != low[i]), counts[0])
    if first < len(tensors):
        mine = f"{names[first]}: {texts[first]}"
    else:
        mine = f"none (this rank has {len(tensors)} parameters)"
    raw = mine.encode()[:_TEXT_BYTES]
    text = torch.zeros(_TEXT_BYTES, dtype=torch.uint8)
    text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = scatter_gather.all_gather(text.to(device), group=group).cpu().view(-1, _TEXT_BYTES)
    ranks = []
    for rank, row in enumerate(gathered):
        said = bytes(row.tolist()).rstrip(b"\0").decode(errors="replace")
        ranks.append(f"rank {rank}: {said}")
    count_note = (f"the ranks have {counts[0]} to {counts[1]} parameters; " if counts[0] != counts[1] else "")
    raise ValueError(
        f"ringreduce.{who}: the ranks' models differ: {count_note}parameter #{first} (in registration order, "
        f"counting those that require grad) differs: {'; '.join(ranks)}. Every rank must build the same model "
        "(same parameters, order, shapes and dtypes) before constructing the averager"
    )


def check_model(module_or_params: Any, params: list[torch.Tensor], tensors: list[torch.Tensor], group: Any,
                who: str = "GradientAverager") -> None:
    """GradientAverager's construction checks: a UserWarning for a DistributedDataParallel module (its
    gradients would be averaged twice), then check_same_parameters of the bucketed `tensors` where
    this rank is in a `group` of several ranks (parameters named as in the module, else by index)."""
    if isinstance(module_or_params, DistributedDataParallel):
        warnings.warn(
            "ringreduce.GradientAverager: this module is wrapped in DistributedDataParallel, which already "
            "averages its gradients: they would be averaged twice. Give the averager the unwrapped model "
            "instead of DDP, or keep DDP and use ringreduce inside it: "
            "ddp.register_comm_hook(state=None, hook=ringreduce.ddp_comm_hook)",
            UserWarning,
            stacklevel=3,
        )
    info = resolve(group)
    if info is not None and info.size > 1:
        names = {}
        if isinstance(module_or_params, torch.nn.Module):
            names = {id(p): name for name, p in module_or_params.named_parameters()}
        check_same_parameters(tensors, [names.get(id(p), f"parameter {i}") for i, p in enumerate(params)], group, who)
