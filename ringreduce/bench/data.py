"""Exact, position-dependent test data whose all-reduce result is known in closed form.

Rank r holds ``v(i, r) = (5 i + 3 r + 1) mod k`` at element i, k <= 16 chosen so that the sum over
ranks is exact in the element type. k is never a multiple of 3, so every k consecutive ranks contribute
each residue once: the sum over n ranks is ``(n // k) k (k-1) / 2`` plus the first ``n % k`` ranks'
terms, and the checker never needs the other ranks' data.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 22  # elements per chunk of int64 temporaries (32 MiB)

_EXACT_LIMIT = {
    torch.float32: 1 << 24,
    torch.float64: 1 << 53,
    torch.float16: 2048,
    torch.bfloat16: 256,
    torch.int8: 127,
    torch.uint8: 255,
    torch.int32: (1 << 31) - 1,
    torch.int64: (1 << 63) - 1,
}


def pattern_modulus(dtype: torch.dtype, world_size: int) -> int:
    """The modulus k of the pattern: as large as 16 while n (k-1) stays exact in `dtype`."""
    limit = _EXACT_LIMIT.get(dtype, 1 << 24)
    k = max(2, min(16, limit // max(1, world_size) + 1))
    if k % 3 == 0:
        k -= 1
    return k


def _values(start: int, end: int, rank: int, k: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(start, end, dtype=torch.int64, device=device)
    return (idx * 5 + (3 * rank + 1)) % k


def fill_pattern(tensor: torch.Tensor, rank: int, k: int) -> None:
    """Writes rank `rank`'s pattern into the contiguous `tensor` in place."""
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), CHUNK):
        end = min(start + CHUNK, flat.numel())
        flat[start:end].copy_(_values(start, end, rank, k, flat.device))


def expected_chunk(
    start: int, end: int, world_size: int, k: int, op: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The reduced values of elements [start, end): the sum over ranks, or for op "avg" the exact sum / n
    in float64 for double, float32 otherwise, rounded once to `dtype` (as ringreduce and ``div_`` do)."""
    full, rem = divmod(world_size, k)
    total = torch.full((end - start,), full * (k * (k - 1) // 2), dtype=torch.int64, device=device)
    for r in range(rem):
        total += _values(start, end, r, k, device)
    if op == "sum":
        return total.to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (total.to(acc) / world_size).to(dtype)


def count_wrong(
    tensor: torch.Tensor, world_size: int, k: int, op: str, rtol: float = 0.0
) -> int:
    """Number of elements of the reduced `tensor` that differ from the known result: exactly with
    ``rtol == 0``, else beyond relative difference `rtol` (stock NCCL's AVG pre-multiplies by 1/n)."""
    flat = tensor.view(-1)
    wrong = 0
    for start in range(0, flat.numel(), CHUNK):
        end = min(start + CHUNK, flat.numel())
        want = expected_chunk(start, end, world_size, k, op, flat.dtype, flat.device)
        got = flat[start:end]
        if rtol > 0:
            bad = ~torch.isclose(got.double(), want.double(), rtol=rtol, atol=0.0)
        else:
            bad = got != want
        wrong += int(bad.sum().item())
    return wrong
