"""The error columns of ``--wire-dtype``: ||result - ref|| / ||ref|| against the float64 average (or sum).

Every rank regenerates every rank's seeded inputs, so the reference needs no communication.
"""

from __future__ import annotations

import torch

from ringreduce.bench.impls import Impl

CHUNK = 1 << 22  # elements of float64 temporaries at a time


def _inputs(rank: int, count: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(4242 + rank)
    return (torch.randn(count, generator=g) * (1 + rank)).to(device)


def relative_errors(impls: list[Impl], op: str, count: int, rank: int, world_size: int,
                    device: torch.device) -> dict[str, float]:
    """{name: relative L2 error} of each of `impls` reducing (`op`) `count` random float32s on `device`."""
    results = {}
    for impl in impls:
        t = _inputs(rank, count, device)
        impl.enter()
        impl.run(t)
        results[impl.name] = t.cpu()
    err2 = dict.fromkeys(results, 0.0)
    ref2 = 0.0
    everyone = [_inputs(r, count, torch.device("cpu")) for r in range(world_size)]
    for start in range(0, count, CHUNK):
        end = min(start + CHUNK, count)
        ref = sum(x[start:end].double() for x in everyone)
        if op == "avg":
            ref = ref / world_size
        ref2 += float((ref * ref).sum())
        for name, got in results.items():
            d = got[start:end].double() - ref
            err2[name] += float((d * d).sum())
    return {name: (e / ref2) ** 0.5 if ref2 > 0 else 0.0 for name, e in err2.items()}
