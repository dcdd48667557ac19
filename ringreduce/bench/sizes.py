"""Message sizes and element types: parsing "8", "1K", "256M" and the nccl-tests type names."""

from __future__ import annotations

from typing import NamedTuple

import torch

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class DType(NamedTuple):
    """An element type the benchmark sweeps: its nccl-tests name and torch dtype."""

    name: str  # nccl-tests spelling: float, double, half, bfloat16, int8, uint8, int32, int64
    torch_dtype: torch.dtype


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float", torch.float32),
        DType("double", torch.float64),
        DType("half", torch.float16),
        DType("bfloat16", torch.bfloat16),
        DType("int8", torch.int8),
        DType("uint8", torch.uint8),
        DType("int32", torch.int32),
        DType("int64", torch.int64),
    )
}
_ALIASES = {"float32": "float", "float64": "double", "float16": "half", "fp32": "float", "fp16": "half",
            "bf16": "bfloat16", "int": "int32", "long": "int64"}


def parse_dtype(text: str) -> DType:
    """Returns the DType named `text` (nccl-tests or torch spelling); raises ValueError otherwise."""
    key = text.strip().lower().replace("torch.", "")
    key = _ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}; choose from {', '.join(DTYPES)} (or float32, float16, bf16, ...)")
    return DTYPES[key]


def parse_dtypes(text: str) -> list[DType]:
    """The DTypes of a comma-separated list ("float,bfloat16,half"), in order, each once; raises ValueError
    for an unknown or empty one."""
    names = [part for part in (p.strip() for p in text.split(",")) if part]
    if not names:
        raise ValueError(f"no dtype in {text!r}; choose from {', '.join(DTYPES)}")
    return list({d.name: d for d in map(parse_dtype, names)}.values())


def parse_size(text: str) -> int:
    """Parses a byte count with an optional binary unit: "8", "1K", "16M", "1G" (K = 1024, as nccl-tests)."""
    raw = text.strip().upper()
    if raw.endswith("IB"):
        raw = raw[:-2]
    unit = raw[-1] if raw and raw[-1] in _UNITS else ""
    number = raw[: len(raw) - len(unit)] if unit else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 8, 1K, 16M, 1G") from None
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def format_size(size: int) -> str:
    """Short binary form for labels: 1024 -> "1K", 64 MiB -> "64M", 1000 -> "1000"."""
    for unit in ("G", "M", "K"):
        scale = _UNITS[unit]
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def size_sweep(begin: int, end: int, factor: float | None, increment: int | None, itemsize: int) -> list[int]:
    """The byte sizes from `begin` to `end` inclusive, multiplied by `factor` or stepped by `increment`,
    rounded down to whole elements of `itemsize` (as nccl-tests), without empties or repeats."""
    if begin > end:
        raise ValueError(f"begin size {begin} is larger than end size {end}")
    if increment is not None and increment <= 0:
        raise ValueError("increment must be positive")
    if increment is None and (factor is None or factor <= 1):
        raise ValueError("factor must be > 1 (or give an increment)")
    out: list[int] = []
    size = begin
    while size <= end:
        rounded = (size // itemsize) * itemsize
        if rounded > 0 and rounded not in out:
            out.append(rounded)
        if increment is not None:
            size += increment
        else:
            assert factor is not None
            size = max(size + 1, int(size * factor))
    return out
