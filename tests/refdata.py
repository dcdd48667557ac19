"""Exact, position-dependent test data and float64 references built from an all_gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

FLOAT_TYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_TYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
COMPLEX_TYPES = [torch.complex64, torch.complex128]
ALL_TYPES = FLOAT_TYPES + INT_TYPES + [torch.bool] + COMPLEX_TYPES
OPS = ["sum", "avg", "max", "min", "product"]
# The dtypes of the exact sweeps over gloo point-to-point (ranks.py's Note [Places]): that
# transport moves bytes, so one type per element size (1, 2, 4, 8, 16 bytes), both 16-bit floats (they
# convert to float32 partials) and bool (a logical reduction) reach its paths; the core arithmetic of
# every dtype is swept over shared memory.
TCP_TYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.complex128]


def types_for(transport: str) -> list[torch.dtype]:
    """The dtypes an exact every-dtype sweep covers over `transport` ("shm": all of them)."""
    return ALL_TYPES if transport == "shm" else TCP_TYPES


def supported(dtype: torch.dtype, op: str) -> bool:
    if op == "avg" and (dtype in INT_TYPES or dtype == torch.bool):
        return False
    if dtype in COMPLEX_TYPES and op in ("max", "min", "product"):
        return False
    return True


def exact_input(numel: int, rank: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Values whose reductions are exact in every dtype and differ by position and rank.

    Floats: integers in [-8, 8] (sums of 5 ranks stay <= 40, exact even in bfloat16); for PRODUCT
    powers of two in {+-0.5, +-1, +-2}. Integers: up to 100, so int8/uint8 sums and products wrap.
    """
    i = torch.arange(numel, dtype=torch.int64)
    if dtype == torch.bool:
        return ((i * 3 + rank) % 4 == 0) if op in ("sum", "max") else ((i + rank) % 5 != 0)
    if dtype in INT_TYPES:
        v = (i * 37 + rank * 11 + 5) % 100
        if dtype != torch.uint8:
            v = v - 40
        return v.to(dtype)
    if op == "product":
        choices = torch.tensor([0.5, 1.0, 2.0, -1.0, -2.0, 1.0, 2.0], dtype=torch.float64)
        v = choices[(i * 5 + rank * 3) % len(choices)]
    else:
        v = ((i * 7 + rank * 5) % 17 - 8).to(torch.float64)
    if dtype in COMPLEX_TYPES:
        im = ((i * 3 + rank) % 9 - 4).to(torch.float64)
        return torch.complex(v, im).to(dtype)
    return v.to(dtype)


def gather_inputs(t: torch.Tensor, group=None) -> torch.Tensor:
    """All ranks' copies of `t` stacked on a new dim 0 (gathered as raw bytes: works for any dtype)."""
    flat = torch.empty(t.shape, dtype=t.dtype).copy_(t).view(-1)  # dense even for odd-stride size-1 dims
    raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    n = dist.get_world_size(group)
    outs = [torch.empty_like(raw) for _ in range(n)]
    dist.all_gather(outs, raw, group=group)
    return torch.stack([o.view(t.dtype).view(t.shape) if o.numel() else t.new_empty(t.shape) for o in outs])


def reference(stack: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce the gathered inputs locally: float64 for floats/complex, wrapping int64 for integers."""
    dtype = stack.dtype
    n = stack.shape[0]
    if dtype == torch.bool:
        if op in ("sum", "max"):
            return stack.any(0)
        return stack.all(0)
    if dtype in INT_TYPES:
        w = stack.to(torch.int64)
        if op == "sum":
            r = w.sum(0)
        elif op == "product":
            r = w.prod(0)
        elif op == "max":
            r = w.max(0).values
        else:
            r = w.min(0).values
        return r.to(dtype)  # int64 -> narrower wraps, like torch's own integer arithmetic
    wide = stack.to(torch.complex128 if dtype in COMPLEX_TYPES else torch.float64)
    if op == "sum":
        r = wide.sum(0)
    elif op == "avg":
        r = wide.sum(0)
        # per component: sum / n correctly rounded (complex division by a complex n is not)
        r = torch.complex(r.real / n, r.imag / n) if r.is_complex() else r / n
    elif op == "product":
        r = wide.prod(0)
    elif op == "max":
        r = wide.max(0).values
    else:
        r = wide.min(0).values
    return r.to(dtype)


def same_on_all_ranks(t: torch.Tensor, group=None) -> bool:
    """Bitwise equality of `t` across ranks."""
    stack = gather_inputs(t, group)
    raw = stack.reshape(stack.shape[0], -1).contiguous()
    if raw.numel() == 0:
        return True
    b = raw.view(torch.uint8) if raw.dtype != torch.bool else raw.to(torch.uint8)
    return all(torch.equal(b[0], b[i]) for i in range(1, b.shape[0]))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    if a.dtype == torch.bool:
        return torch.equal(a.cpu(), b.cpu())
    da = torch.empty(a.shape, dtype=a.dtype).copy_(a).view(-1)
    db = torch.empty(b.shape, dtype=b.dtype).copy_(b).view(-1)
    return torch.equal(da.view(torch.uint8), db.view(torch.uint8))


def chunk_bounds(n: int, numel: int, dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """The ring's chunks (Note [Chunk ownership], csrc/core/schedule.h), from the native plan."""
    from ringreduce._native import C

    return [tuple(b) for b in C.plan_summary(n, 0, numel, C.dtype_code(dtype))["chunks"]]


def ring_reference(inputs: list[torch.Tensor], op: str = "avg", wire: torch.dtype | None = None,
                   factor: float | None = None, extra: int = 1) -> torch.Tensor:
    """What the flat ring computes from rank r's float32 `inputs[r]`: chunk c takes rank c's value
    first, then c + 1's, ..., each entering divided by `factor`; partials rounded to `wire` per hop;
    the final sum scaled once (AVG: / (n * extra / factor); SUM: * factor, or / (extra / factor))."""
    n = len(inputs)
    numel = inputs[0].numel()
    out = torch.empty(numel, dtype=torch.float32)
    f32 = torch.float32
    f = torch.tensor(factor, dtype=f32) if factor else None

    def enter(t: torch.Tensor) -> torch.Tensor:
        return t / f if f is not None else t

    for c, (b, e) in enumerate(chunk_bounds(n, numel)):
        if b >= e:
            continue
        xs = [inputs[(c + j) % n].reshape(-1)[b:e] for j in range(n)]
        p = enter(xs[0])
        if wire is not None:
            p = p.to(wire)
        for k in range(1, n):
            s = enter(xs[k]) + p.to(f32)
            p = s.to(wire) if (wire is not None and k < n - 1) else s
        divisor = n * extra if op == "avg" else (extra if extra > 1 else 0)
        if divisor:
            q = torch.tensor(float(divisor), dtype=f32)
            if f is not None:
                q = q / f
            p = p / q
        elif f is not None:
            p = p * f
        out[b:e] = p
    return out
