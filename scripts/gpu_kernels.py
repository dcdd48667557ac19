"""ringreduce's reduce kernel on one GPU: against torch for every dtype/op, and its bandwidth.

Run by scripts/gpu_check.sh (needs a CUDA build of ringreduce and one GPU):

* correctness: ``out = op(a, b)`` (and AVG's final division) through ``ringreduce._C._cuda_reduce``
  (the kernel the ring launches) against torch, for every supported dtype and op, at sizes that
  cover the scalar head, the 16-byte vector body and the tail, and at misaligned storage offsets;
* bandwidth: SUM and AVG of two 256 MiB inputs into a third buffer for float32, bfloat16 and float16
  (the same bytes each), bytes read + written per second, each next to a device-to-device copy of the
  buffer (``dst.copy_(src)``: bytes read + written per second) timed just before it, and its time
  over float32 SUM's. Target (benchmarks/README.md; issue 48 for the half types): every kernel
  >= 85% of the copy.

Prints one line per check and writes ``--json`` if given. Exit code 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
COMPLEX = [torch.complex64, torch.complex128]


def _supported(dtype: torch.dtype, op: str) -> bool:
    if dtype in COMPLEX:
        return op in ("sum", "avg")
    if dtype in INTS:
        return op != "avg"
    return True


def _inputs(dtype: torch.dtype, n: int, dev: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype in INTS or dtype == torch.bool:
        return torch.randint(0, 100, (n,), generator=g).to(dtype).to(dev)
    if dtype in COMPLEX:
        return torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype).to(dev)
    return torch.randn(n, generator=g).to(dtype).to(dev)


def _reference(a: torch.Tensor, b: torch.Tensor, op: str, divisor: int) -> torch.Tensor:
    wide = torch.float64 if a.dtype in (torch.float64, torch.complex128) else torch.float32
    if a.dtype in INTS:
        # integer arithmetic wraps as torch's does
        return {"sum": a + b, "max": torch.maximum(a, b), "min": torch.minimum(a, b), "product": a * b}[op]
    if a.dtype in COMPLEX:
        s = a + b
        return s / divisor if op == "avg" else s
    x, y = a.to(wide), b.to(wide)
    if op == "sum":
        return (x + y).to(a.dtype)
    if op == "avg":
        return ((x + y).to(a.dtype).to(wide) / divisor).to(a.dtype)
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    return (x * y).to(a.dtype)


def check_all(C, dev: torch.device, dtypes: list[torch.dtype] | None = None) -> list[str]:
    failures = []
    for dtype in dtypes or INTS + FLOATS + COMPLEX:
        for op, code in OPS.items():
            if not _supported(dtype, op):
                continue
            for n in (1, 7, 33, 4099, 1 << 20):
                for offset in (0, 1, 3):
                    a = _inputs(dtype, n + offset, dev, 1)[offset:]
                    b = _inputs(dtype, n + offset, dev, 2)[offset:]
                    out = torch.empty(n + offset, dtype=dtype, device=dev)[offset:]
                    divisor = 3 if op == "avg" else 0
                    C._cuda_reduce(a, b, out, code, divisor)
                    want = _reference(a, b, op, divisor)
                    if dtype in INTS or op in ("max", "min"):
                        ok = torch.equal(out, want)
                    else:
                        tol = {torch.float16: 1e-3, torch.bfloat16: 8e-3}.get(dtype, 1e-6)
                        ok = torch.allclose(out, want, rtol=tol, atol=tol)
                    if not ok:
                        failures.append(f"{dtype} {op} n={n} offset={offset}")
    return failures


def _time(fn, iters: int, dev: torch.device) -> float:
    """Seconds per call of `iters` back-to-back calls on `dev` after 3 untimed ones (the benchmark's timing)."""
    from ringreduce.bench.timing import time_round

    for _ in range(3):
        fn()
    return time_round(fn, iters, dev)


BANDWIDTH_TYPES = (torch.float32, torch.bfloat16, torch.float16)


def bandwidth(C, dev: torch.device, nbytes: int = 256 << 20, iters: int = 20) -> list[dict]:
    """One row per (dtype, op) of BANDWIDTH_TYPES x (sum, avg): the kernel's and the copy's GB/s, the
    kernel's share of the copy's, its time over float32 SUM's (the first row) at the same bytes, and
    whether its result was right (1 + 2, and (1 + 2) / 2: exact in each type)."""
    src = torch.ones(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    rows: list[dict] = []
    for dtype in BANDWIDTH_TYPES:
        n = nbytes // dtype.itemsize
        a = torch.ones(n, dtype=dtype, device=dev)
        b = torch.full((n,), 2.0, dtype=dtype, device=dev)
        out = torch.empty(n, dtype=dtype, device=dev)
        for op, want in (("sum", 3.0), ("avg", 1.5)):
            code, divisor = OPS[op], 2 if op == "avg" else 0
            t_copy = _time(lambda: dst.copy_(src), iters, dev)
            t_kernel = _time(lambda: C._cuda_reduce(a, b, out, code, divisor), iters, dev)  # noqa: B023 (called here)
            kernel_gbs = 3 * nbytes / t_kernel / 1e9
            copy_gbs = 2 * nbytes / t_copy / 1e9
            base_us = rows[0]["kernel_us"] if rows else t_kernel * 1e6
            rows.append({"dtype": str(dtype).removeprefix("torch."), "op": op, "bytes": nbytes,
                         "kernel_us": t_kernel * 1e6, "kernel_GBps": kernel_gbs, "copy_GBps": copy_gbs,
                         "ratio": kernel_gbs / copy_gbs, "vs_float32_sum": t_kernel * 1e6 / base_us,
                         "right": bool(torch.equal(out, torch.full_like(out, want)))})
    return rows


def bandwidth_lines(rows: list[dict]) -> list[str]:
    from ringreduce.bench.sizes import format_size

    lines = [f"kernel bandwidth, two {format_size(rows[0]['bytes'])} inputs into a third (target >= 0.85 of a D2D "
             "copy of the buffer, timed just before):"]
    for row in rows:
        lines.append(f"  {row['dtype']:>8} {row['op']:<3}: {row['kernel_GBps']:5.0f} GB/s, {row['ratio']:.2f} of the "
                     f"copy's {row['copy_GBps']:.0f} GB/s; time {row['vs_float32_sum']:.2f}x float32 sum's"
                     + ("" if row["right"] else "; WRONG RESULT"))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from ringreduce._native import C

    if not torch.cuda.is_available() or not hasattr(C, "_cuda_reduce"):
        print("gpu_kernels: needs a GPU and a CUDA build of ringreduce", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    failures = check_all(C, dev)
    print(f"kernels vs torch: {'all dtypes/ops match' if not failures else f'{len(failures)} MISMATCHES'}")
    for f in failures[:20]:
        print(f"  mismatch: {f}")
    bw = bandwidth(C, dev)
    print("\n".join(bandwidth_lines(bw)))
    failures += [f"bandwidth run: {row['dtype']} {row['op']} gave a wrong result" for row in bw if not row["right"]]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(dev), "mismatches": failures, "bandwidth": bw}, fh,
                      indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
