"""The accuracy columns of ``--wire-dtype``, ``--vs`` and ``--algorithms direct``: each implementation's
result on random data against the float64 average (or sum). Every rank regenerates every rank's seeded
inputs, so the reference needs no communication.
"""

from __future__ import annotations

import torch

from ringreduce.bench.impls import Impl

CHUNK = 1 << 22  # elements of float64 temporaries at a time


def _inputs(rank: int, count: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(4242 + rank)
    return (torch.randn(count, generator=g, dtype=torch.float64) * (1 + rank)).to(device=device, dtype=dtype)


def accuracy(impls: list[Impl], op: str, count: int, rank: int, world_size: int, dtype: torch.dtype,
             device: torch.device) -> dict[str, dict[str, float | int]]:
    """{name: {"rel_error", "off", "off_exact"}} of each of `impls` reducing (`op`) this rank's `count`
    random elements of `dtype` on `device`: the relative L2 error against the float64 result, the
    elements that differ from it rounded once to `dtype` (0: correctly rounded), and those among the
    elements whose float32 sum (float64 for float64) is exact."""
    results = {}
    for impl in impls:
        t = _inputs(rank, count, dtype, device)
        impl.enter()
        impl.run(t)
        results[impl.name] = t.cpu()
    everyone = [_inputs(r, count, dtype, torch.device("cpu")) for r in range(world_size)]
    err2, off, off_exact = dict.fromkeys(results, 0.0), dict.fromkeys(results, 0), dict.fromkeys(results, 0)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ref2 = 0.0
    for start in range(0, count, CHUNK):
        end = min(start + CHUNK, count)
        total = sum(x[start:end].double() for x in everyone)
        exact = sum(x[start:end].to(acc) for x in everyone).double() == total  # the float32 sum is exact
        ref = total / world_size if op == "avg" else total
        ref2 += float((ref * ref).sum())
        for name, got in results.items():
            d = got[start:end].double() - ref
            err2[name] += float((d * d).sum())
            wrong = got[start:end] != ref.to(dtype)
            off[name] += int(wrong.sum())
            off_exact[name] += int((wrong & exact).sum())
    return {name: {"rel_error": (e / ref2) ** 0.5 if ref2 > 0 else 0.0, "off": off[name], "off_exact": off_exact[name]}
            for name, e in err2.items()}
