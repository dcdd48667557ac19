"""The GPU path's logic, run on the CPU (no GPU, no NCCL, no ringreduce._C needed).

Two parts of csrc/cuda are plain C++ and are compiled here with the host compiler into a small
ctypes library (tests/cpp/cuda/cuda_logic_capi.cpp):

* the reduce kernel's body (csrc/core/reduce_body.h) through the kernel's own dtype dispatch
  (csrc/core/reduce_dispatch.h), on a simulated grid of threads, compared with torch on every
  dtype, op and float32-partial variant, at misaligned addresses (scalar head, vector body, tail);
* the GPU ring executor (csrc/cuda/ring_executor.cpp, what CudaRing runs over NCCL and CUDA streams)
  on simulated CUDA streams with random interleavings and a vector-clock race detector
  (tests/cpp/cuda/sim_device.h): whole all-reduces on n in-process ranks with exact,
  position-dependent data, back-to-back and asynchronous calls sharing the staging slots, and
  deliberately broken interpreter decisions that must be caught;
* the stages of the other GPU collectives through the same driver (csrc/cuda/ring_executor.h):
  reduce-scatter-only and all-gather-only rings (rank r owns block r), an AVG divisor larger than
  the ring, rings over rank lists of one communicator running side by side (the NCCL peers each
  rank used must be the mapped ranks), and the hierarchical all-reduce's three stages.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import source_list  # tools/ (pyproject.toml: pythonpath)
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["tests/cpp/cuda/cuda_logic_capi.cpp", "tests/cpp/cuda/sim_device.cpp",
           *source_list.sources(ROOT, "core", "cuda_logic")]  # csrc/sources.cmake's groups
HEADERS = [
    "tests/cpp/cuda/sim_device.h",
    "csrc/cuda/ring_executor.h",
    "csrc/cuda/reduce_args.h",
    "csrc/cuda/direct_executor.h",
    "csrc/cuda/gpu_pipeline.h",
    "csrc/core/collectives.h",
    "csrc/core/direct.h",
    "csrc/core/reduce_body.h",
    "csrc/core/one_shot_body.h",
    "csrc/core/reduce_dispatch.h",
    "csrc/core/functors.h",
    "csrc/core/plan.h",
    "csrc/core/schedule.h",
    "csrc/core/dtype.h",
    "csrc/core/common.h",
    "csrc/core/error.h",
]

# csrc/core/dtype.h codes
DTYPES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int8: 4,
    torch.int16: 5,
    torch.int32: 6,
    torch.int64: 7,
    torch.uint8: 8,
    torch.bool: 9,
    torch.complex64: 10,
    torch.complex128: 11,
}
SUM, AVG, MAX, MIN, PRODUCT = range(5)
OPS = {"SUM": SUM, "AVG": AVG, "MAX": MAX, "MIN": MIN, "PRODUCT": PRODUCT}
HALF = (torch.float16, torch.bfloat16)
FLOATING = (torch.float32, torch.float64, *HALF)
COMPLEX = (torch.complex64, torch.complex128)


def supported(dtype: torch.dtype, op: int) -> bool:
    if op == AVG:
        return dtype in FLOATING or dtype in COMPLEX
    if dtype in COMPLEX:
        return op == SUM
    return True


class SimDirect(ctypes.Structure):
    """RrSimDirect of tests/cpp/cuda/cuda_logic_capi.cpp: one rr_sim_direct run."""

    _fields_ = [("nranks", ctypes.c_int), ("numel", ctypes.c_longlong), ("dtype", ctypes.c_int), ("op", ctypes.c_int),
                ("accum_narrow", ctypes.c_int), ("wire_dtype", ctypes.c_int), ("predivide", ctypes.c_double),
                ("extra_divisor", ctypes.c_int), ("segment_bytes", ctypes.c_longlong),
                ("staging_bytes", ctypes.c_longlong), ("ncalls", ctypes.c_int), ("one_shot_mask", ctypes.c_ulonglong),
                ("seed", ctypes.c_ulonglong), ("fault", ctypes.c_int)]


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    h = hashlib.sha256()
    for rel in SOURCES + HEADERS:
        h.update((ROOT / rel).read_bytes())
    # A cache in the repository's ignored build folders (nothing is left in /tmp), one per source hash.
    out_dir = ROOT / "build-tests" / f"cuda_logic_{h.hexdigest()[:16]}"
    so = out_dir / "libcudalogic.so"
    if not so.exists():
        cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        assert cxx, "a C++ compiler is needed to build the GPU-logic test library (set CXX)"
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f"libcudalogic.{os.getpid()}.so"
        objs = [out_dir / f"{Path(src).stem}.{os.getpid()}.o" for src in SOURCES]
        cmds = [[cxx, "-std=c++17", "-O2", "-fPIC", "-c", "-o", str(obj), str(ROOT / src)]
                for src, obj in zip(SOURCES, objs, strict=True)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # one compiler per core
            procs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), cmds))
        cmds.append([cxx, "-shared", "-o", str(tmp)] + [str(obj) for obj in objs])
        if all(p.returncode == 0 for p in procs):
            procs.append(subprocess.run(cmds[-1], capture_output=True, text=True))
        for obj in objs:
            obj.unlink(missing_ok=True)
        for cmd, proc in zip(cmds, procs, strict=True):
            assert proc.returncode == 0, f"building the GPU-logic test library failed:\n{' '.join(cmd)}\n{proc.stderr}"
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so))
    lib.rr_kernel_reduce.restype = ctypes.c_int
    lib.rr_kernel_reduce.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_longlong, ctypes.c_int, ctypes.c_double, ctypes.c_double, ctypes.c_int, ctypes.c_int,
        ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_int,
    ]
    lib.rr_sim_ring.restype = ctypes.c_int
    lib.rr_sim_ring.argtypes = [
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int,
        ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_double,
        ctypes.c_longlong, ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
        ctypes.c_char_p, ctypes.c_int,
    ]
    lib.rr_sim_mixed.restype = ctypes.c_int
    lib.rr_sim_mixed.argtypes = [
        ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_double,
        ctypes.c_int, ctypes.c_longlong, ctypes.c_int,
        ctypes.c_longlong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int,
        ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
        ctypes.c_char_p, ctypes.c_int,
    ]
    lib.rr_sim_direct.restype = ctypes.c_int
    lib.rr_sim_direct.argtypes = [
        ctypes.POINTER(SimDirect), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_int,
    ]
    lib.rr_gpu_pipeline.restype = ctypes.c_int
    lib.rr_gpu_pipeline.argtypes = [
        ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
        ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.POINTER(ctypes.c_longlong), ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.rr_sim_allreduce.restype = ctypes.c_int
    lib.rr_sim_allreduce.argtypes = [
        ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_double,
        ctypes.c_longlong,
        ctypes.c_int, ctypes.c_longlong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_int,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_char_p, ctypes.c_int,
    ]
    return lib


# ---------------------------------------------------------------------------------------------
# The kernel body against torch


def kernel_reduce(lib, dtype, op, a, b, dst, *, divisor=0, round_sum=True, nthreads=5, postscale=0.0,
                  predivide=0.0):
    """The kernel body on (a, b, dst) with their own dtypes (`dtype`: a's); b None: the convert.
    `divisor` applies to AVG only, as the plan passes it (Scaling, csrc/core/functors.h)."""
    kind = ctypes.c_int(0)
    err = ctypes.create_string_buffer(2048)
    b_ptr, b_type = (None, DTYPES[dst.dtype]) if b is None else (b.data_ptr(), DTYPES[b.dtype])
    rc = lib.rr_kernel_reduce(
        op, a.data_ptr(), DTYPES[dtype], b_ptr, b_type, dst.data_ptr(), DTYPES[dst.dtype], a.numel(),
        divisor if op == AVG else 0, float(postscale), float(predivide), int(round_sum), nthreads,
        ctypes.byref(kind), err, len(err),
    )
    return rc, kind.value, err.value.decode()


def random_values(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
        return torch.randint(lo, hi, (n,), generator=gen, dtype=torch.int64).to(dtype)
    if dtype in COMPLEX:
        real = torch.float32 if dtype == torch.complex64 else torch.float64
        return torch.complex(torch.randn(n, generator=gen, dtype=real), torch.randn(n, generator=gen, dtype=real)) * 50
    x = torch.randn(n, generator=gen, dtype=torch.float64) * 300
    if n >= 8:  # specials: NaN on either side, infinities, fp16 overflow
        x[1] = float("nan")
        x[3] = float("inf")
        x[5] = -float("inf")
        x[6] = 60000.0
    return x.to(dtype)


def reference(dtype, op, a, b, dst_dtype, divisor, round_sum):
    """What ReduceStep must produce, computed with torch ops in the accumulation precision."""
    if dtype == torch.bool:
        return (a | b) if op in (SUM, MAX) else (a & b)
    if dtype in COMPLEX:
        s = a.to(dtype) + b.to(dtype)
        if op == AVG and divisor > 0:
            s = torch.complex(s.real / divisor, s.imag / divisor)
        return s
    if dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        return {SUM: a + b, PRODUCT: a * b, MAX: torch.maximum(a, b), MIN: torch.minimum(a, b)}[op]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x, y = a.to(acc), b.to(acc)
    if op in (SUM, AVG):
        s = x + y
    elif op == PRODUCT:
        s = x * y
    elif op == MAX:
        s = torch.maximum(x, y)
    else:
        s = torch.minimum(x, y)
    if op == AVG and divisor > 0:
        if round_sum:
            s = s.to(dst_dtype).to(acc)
        s = s / divisor
    return s.to(dst_dtype)


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point() or x.is_complex():
        xr, yr = (torch.view_as_real(x), torch.view_as_real(y)) if x.is_complex() else (x, y)
        both_nan = torch.isnan(xr) & torch.isnan(yr)
        return bool(((xr == yr) | both_nan).all())
    return bool((x == y).all())


def width_variants(dtype, op=SUM):
    """(b dtype, dst dtype) pairs the plan produces: float32 partials for half types, 16-bit partials
    for float32 (SUM and AVG)."""
    if dtype in HALF:
        return [(dtype, dtype), (dtype, torch.float32), (torch.float32, torch.float32), (torch.float32, dtype)]
    if dtype == torch.float32 and op in (SUM, AVG):
        return [(dtype, dtype)] + [(p, d) for p in HALF for d in (p, torch.float32)]
    return [(dtype, dtype)]


@pytest.mark.parametrize("dtype", list(DTYPES), ids=lambda d: str(d).replace("torch.", ""))
def test_kernel_body_matches_torch(lib, dtype):
    gen = torch.Generator().manual_seed(1234 + DTYPES[dtype])
    checked = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for b_dtype, dst_dtype in width_variants(dtype, op):
            for count in (0, 1, 3, 8, 33, 257):
                # misalign a, b and dst independently: head, vector body with per-operand
                # vector/scalar loads, tail
                for offs in ((0, 0, 0), (1, 0, 1), (0, 3, 2), (5, 1, 0), (2, 2, 2)):
                    for divisor, round_sum in ((0, True), (3, True), (3, False)) if op == AVG else ((0, True),):
                        a_full = random_values(dtype, count + 8, gen)
                        b_src = b_dtype if (b_dtype != torch.float32 or dtype == torch.float32) else dtype
                        b_full = random_values(b_src, count + 8, gen).to(b_dtype)
                        d_full = torch.zeros(count + 8, dtype=dst_dtype)
                        a = a_full[offs[0] : offs[0] + count]
                        b = b_full[offs[1] : offs[1] + count]
                        dst = d_full[offs[2] : offs[2] + count]
                        before = d_full.clone()
                        for nthreads in (1, 4):
                            dst.fill_(0)
                            rc, kind, msg = kernel_reduce(lib, dtype, op, a, b, dst, divisor=divisor,
                                                          round_sum=round_sum, nthreads=nthreads)
                            assert rc == 0, msg
                            want = reference(dtype, op, a, b, dst_dtype, divisor, round_sum)
                            assert same_bits(dst, want), (
                                f"{op_name} {dtype} b={b_dtype} dst={dst_dtype} count={count} offs={offs} "
                                f"divisor={divisor} round_sum={round_sum} nthreads={nthreads}\n"
                                f"a={a}\nb={b}\ngot={dst}\nwant={want}"
                            )
                        outside = torch.cat([d_full[: offs[2]], d_full[offs[2] + count :]])
                        assert same_bits(outside, torch.cat([before[: offs[2]], before[offs[2] + count :]]))
                        checked += 1
    assert checked > 0


def test_kernel_body_in_place(lib):
    """dst aliases a, as in the reduce-scatter (data = data + staging)."""
    gen = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for off in range(4):
            a_full = random_values(dtype, 200, gen)
            b = random_values(dtype, 150, gen)
            a = a_full[off : off + 150]
            want = reference(dtype, SUM, a.clone(), b, dtype, 0, True)
            rc, _, msg = kernel_reduce(lib, dtype, SUM, a, b, a, nthreads=3)
            assert rc == 0, msg
            assert same_bits(a, want)


def test_kernel_body_refuses_unsupported(lib):
    x = torch.zeros(4, dtype=torch.int32)
    rc, kind, msg = kernel_reduce(lib, torch.int32, AVG, x, x, x)
    assert rc != 0 and kind == 0 and "AVG" in msg  # kType -> TypeError
    c = torch.zeros(4, dtype=torch.complex64)
    rc, kind, msg = kernel_reduce(lib, torch.complex64, MAX, c, c, c)
    assert rc != 0 and kind == 0
    f = torch.zeros(4, dtype=torch.float32)
    # no plan produces (float32, float64) -> float32, nor a 16-bit wire for MAX
    rc, kind, msg = kernel_reduce(lib, torch.float32, SUM, f, torch.zeros(4, dtype=torch.float64), f)
    assert rc != 0 and kind == 2 and "no reduce for operand types" in msg
    rc, kind, msg = kernel_reduce(lib, torch.float32, MAX, f, torch.zeros(4, dtype=torch.bfloat16), f)
    assert rc != 0 and kind == 0 and "16-bit wire" in msg
    rc, kind, msg = kernel_reduce(lib, torch.float64, SUM, torch.zeros(4, dtype=torch.float64), None, f)
    assert rc != 0 and kind == 2 and "no convert" in msg


def test_kernel_convert_and_scaling(lib):
    """The first hop's convert (ConvertBody: float32 to a 16-bit wire, or an in-place predivide) and a
    reduce's predivide and post-scaling (Scaling, csrc/core/functors.h), against torch."""
    gen = torch.Generator().manual_seed(11)
    for count in (1, 7, 64, 203):
        for off in (0, 1, 3):
            a_full = random_values(torch.float32, count + 8, gen)
            a = a_full[off : off + count]
            for wire in HALF:
                for f in (0.0, 3.0):
                    dst = torch.zeros(count + 8, dtype=wire)[off // 2 : off // 2 + count]
                    rc, _, msg = kernel_reduce(lib, torch.float32, SUM, a, None, dst, predivide=f, nthreads=3)
                    assert rc == 0, msg
                    want = (a / torch.tensor(f) if f else a).to(wire)
                    assert same_bits(dst, want), f"convert to {wire} f={f} count={count} off={off}"
            for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.complex64):
                x = random_values(dtype, count, gen)
                want = x.clone()
                if dtype.is_complex:
                    want = torch.complex(want.real / 4.0, want.imag / 4.0)
                else:
                    acc = torch.float64 if dtype == torch.float64 else torch.float32
                    want = (want.to(acc) / 4.0).to(dtype)
                rc, _, msg = kernel_reduce(lib, dtype, SUM, x, None, x, predivide=4.0)  # in place
                assert rc == 0, msg
                assert same_bits(x, want), f"in-place predivide of {dtype}"
    # A reduce: the local operand divided (rounded to its type), then the final scaling.
    a, b = random_values(torch.float32, 100, gen), random_values(torch.bfloat16, 100, gen)
    f32 = torch.float32
    for op, divisor, post, want_fn in (
        (AVG, 3, 2.0, lambda s: s / (torch.tensor(3.0) / torch.tensor(2.0))),
        (AVG, 3, 0.0, lambda s: s / 3),
        (SUM, 0, 2.0, lambda s: s * 2),
    ):
        dst = torch.zeros(100, dtype=f32)
        rc, _, msg = kernel_reduce(lib, torch.float32, op, a, b, dst, divisor=divisor, postscale=post,
                                   predivide=post)
        assert rc == 0, msg
        x = a / torch.tensor(post) if post else a
        assert same_bits(dst, want_fn(x + b.to(f32))), f"op {op} divisor {divisor} post {post}"
    h = random_values(torch.float16, 100, gen)
    dst = torch.zeros(100, dtype=torch.float16)
    rc, _, msg = kernel_reduce(lib, torch.float16, SUM, h, h, dst, predivide=3.0)
    assert rc == 0, msg
    assert same_bits(dst, ((h.to(f32) / 3).to(torch.float16).to(f32) + h.to(f32)).to(torch.float16))


# ---------------------------------------------------------------------------------------------
# The GPU ring executor on simulated streams


def exact_inputs(dtype, op, nranks, numel, call):
    """Position-dependent values whose reduction is exact in every dtype (bf16 sums <= 256)."""
    i = torch.arange(numel, dtype=torch.int64)
    out = []
    for r in range(nranks):
        if dtype == torch.bool:
            v = ((i * 3 + r + call) % 4) == 0
        elif op == PRODUCT:
            v = torch.tensor([-2, -1, 1, 2])[(i * 5 + r * 3 + call) % 4]
        elif op in (MAX, MIN):
            v = ((i * 13 + r * 7 + call) % 23) - 11
        else:
            v = ((i * 7 + r * 5 + call) % 17) - 6
        if dtype in COMPLEX:
            t = torch.complex(v.double(), (v * 2 - 1).double()).to(dtype)
        elif dtype == torch.bool:
            t = v
        else:
            t = v.to(dtype)
        out.append(t.contiguous())
    return out


def expected(dtype, op, inputs, divisor=None):
    """The all-gathered inputs reduced locally in float64/int64 (AVG: divide like the ring, by
    `divisor` when given, else by the number of inputs)."""
    n = divisor or len(inputs)
    if dtype == torch.bool:
        st = torch.stack(inputs)
        return st.any(0) if op in (SUM, MAX) else st.all(0)
    if dtype in COMPLEX:
        s = torch.stack([t.to(torch.complex128) for t in inputs]).sum(0)
        if op == AVG:
            real = torch.float32 if dtype == torch.complex64 else torch.float64
            re, im = s.real.to(real) / n, s.imag.to(real) / n
            return torch.complex(re, im).to(dtype)
        return s.to(dtype)
    if dtype.is_floating_point:
        st = torch.stack([t.to(torch.float64) for t in inputs])
    else:
        st = torch.stack([t.to(torch.int64) for t in inputs])
    if op in (SUM, AVG):
        s = st.sum(0)
    elif op == PRODUCT:
        s = st.prod(0)
    elif op == MAX:
        s = st.max(0).values
    else:
        s = st.min(0).values
    if op == AVG:
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return (s.to(acc) / n).to(dtype)
    if not dtype.is_floating_point:  # wrap like torch's integer arithmetic
        bits = torch.iinfo(dtype).bits
        s = s & ((1 << bits) - 1) if bits < 64 else s
        if bits < 64 and torch.iinfo(dtype).min < 0:
            s = torch.where(s >= (1 << (bits - 1)), s - (1 << bits), s)
        return s.to(dtype)
    return s.to(dtype)


def sim_allreduce(lib, *, nranks, numel, dtype, op, accum=False, segment_bytes=64, num_slots=4,
                  slot_bytes=None, ncalls=1, async_mask=0, seed=1, fault=0, data_offset=0, inputs=None,
                  gather_into_data=True, lanes=1, wire=None, predivide=0.0):
    elem = torch.empty((), dtype=dtype).element_size()
    if slot_bytes is None:
        slot_bytes = max(256, segment_bytes * 4)
    if inputs is None:
        inputs = [exact_inputs(dtype, op, nranks, numel, c) for c in range(ncalls)]
    flat_in = [t for call in inputs for t in call]
    outs = [torch.full((numel,), 0, dtype=dtype) for _ in flat_in]
    in_ptrs = (ctypes.c_void_p * len(flat_in))(*[t.data_ptr() for t in flat_in])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[t.data_ptr() for t in outs])
    err = ctypes.create_string_buffer(8192)
    rc = lib.rr_sim_allreduce(nranks, numel, DTYPES[dtype], op, int(accum), DTYPES[wire] if wire else -1,
                              float(predivide), segment_bytes, num_slots, slot_bytes, ncalls, async_mask, seed, fault,
                              data_offset, int(gather_into_data), lanes, in_ptrs, out_ptrs, err, len(err))
    del elem
    results = [outs[c * nranks : (c + 1) * nranks] for c in range(ncalls)]
    return rc, err.value.decode(), inputs, results


def check_results(dtype, op, inputs, results, label):
    for c, (ins, outs) in enumerate(zip(inputs, results, strict=True)):
        want = expected(dtype, op, ins)
        for r, got in enumerate(outs):
            assert same_bits(got, want), f"{label} call {c} rank {r}:\ngot  {got}\nwant {want}"
            assert same_bits(got, outs[0]), f"{label}: ranks 0 and {r} differ"


SWEEP_DTYPES = list(DTYPES)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_sim_driver_exact(lib, dtype):
    """Every dtype and op, world sizes 2-5, counts around the chunking edges, tiny segments."""
    runs = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for nranks in (2, 3, 5):
            for numel in (1, nranks - 1, nranks + 1, 37, 203):
                if numel <= 0:
                    continue
                for accum in ((False, True) if dtype in HALF else (False,)):
                    seg = 16 if numel < 100 else 48
                    seed = 1000 * nranks + numel + 7 * op
                    rc, msg, ins, outs = sim_allreduce(lib, nranks=nranks, numel=numel, dtype=dtype, op=op,
                                                       accum=accum, segment_bytes=seg, seed=seed,
                                                       num_slots=2 + (numel % 3), data_offset=numel % 3,
                                                       gather_into_data=(numel % 2 == 1))
                    label = f"{op_name} {dtype} n={nranks} numel={numel} accum={accum}"
                    assert rc == 0, f"{label}: {msg}"
                    check_results(dtype, op, ins, outs, label)
                    runs += 1
    assert runs > 0


@pytest.mark.parametrize("nranks", [2, 3, 4])
@pytest.mark.parametrize("num_slots", [1, 2, 4])
def test_sim_driver_many_interleavings(lib, nranks, num_slots):
    """One configuration, many random schedules: back-to-back sync and async calls share the slots."""
    for seed in range(12):
        rc, msg, ins, outs = sim_allreduce(lib, nranks=nranks, numel=301, dtype=torch.float32, op=SUM,
                                           segment_bytes=32, num_slots=num_slots, ncalls=3, async_mask=0b101,
                                           seed=seed, data_offset=1, gather_into_data=seed % 2 == 0)
        assert rc == 0, f"seed {seed}: {msg}"
        check_results(torch.float32, SUM, ins, outs, f"seed {seed}")


def test_sim_driver_avg_bf16_accum_large(lib):
    """AVG with float32 partials over many segments (the plan's kAccum path) and a default-size slot."""
    rc, msg, ins, outs = sim_allreduce(lib, nranks=4, numel=4099, dtype=torch.bfloat16, op=AVG, accum=True,
                                       segment_bytes=256, num_slots=4, ncalls=2, async_mask=0b11, seed=3)
    assert rc == 0, msg
    check_results(torch.bfloat16, AVG, ins, outs, "bf16 avg accum")


def test_sim_driver_random_data_matches_sequential_reduction(lib):
    """Random float32 data: the ring's fixed combination order, reproduced sequentially."""
    gen = torch.Generator().manual_seed(5)
    n, numel = 3, 500
    ins = [[torch.randn(numel, generator=gen) for _ in range(n)]]
    rc, msg, _, outs = sim_allreduce(lib, nranks=n, numel=numel, dtype=torch.float32, op=SUM, segment_bytes=64,
                                     inputs=ins, seed=11)
    assert rc == 0, msg
    ref = torch.stack(ins[0]).double().sum(0)
    for got in outs[0]:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert same_bits(got, outs[0][0])


def gpu_pipeline(lib, nranks, numel, dtype, *, accum=False, staging=16 << 20, segment_bytes=0, slots=0, lanes=0,
                 one_shot_bytes=-1, max_lanes=1):
    """The pipeline rule (csrc/cuda/gpu_pipeline.h) for a communicator of `max_lanes` lanes: (max segment
    bytes, slots, slot bytes, lanes, one-shot bytes)."""
    out = (ctypes.c_longlong * 5)()
    err = ctypes.create_string_buffer(2048)
    rc = lib.rr_gpu_pipeline(nranks, numel, DTYPES[dtype], int(accum), staging, segment_bytes, slots, lanes,
                             one_shot_bytes, max_lanes, out, err, len(err))
    assert rc == 0, err.value.decode()
    return tuple(int(v) for v in out)


def test_results_are_bitwise_independent_of_the_pipeline(lib):
    """Random data, one ring, every pipeline the rule gives for several staging sizes and knobs (segments
    from 16 bytes to whole half-chunks, 1-4 slots): the same bits on every rank, whatever the pipeline
    (Note [Chunk ownership]: ownership depends on (n, numel) only), and for AVG in bf16 with float32
    partials too."""
    gen = torch.Generator().manual_seed(24)
    for n, numel, dtype, op, accum in ((3, 2053, torch.float32, SUM, False), (4, 1031, torch.bfloat16, AVG, True),
                                       (2, 777, torch.float16, AVG, False)):
        ins = [[(torch.randn(numel, generator=gen) * 100).to(dtype) for _ in range(n)]]
        seen = None
        for staging, seg, slots in ((1 << 12, 0, 0), (1 << 14, 0, 3), (16 << 20, 0, 0), (1 << 12, 16, 1),
                                    (1 << 13, 48, 4)):
            max_seg, nslots, slot_bytes, _, _ = gpu_pipeline(lib, n, numel, dtype, accum=accum, staging=staging,
                                                            segment_bytes=seg, slots=slots)
            rc, msg, _, outs = sim_allreduce(lib, nranks=n, numel=numel, dtype=dtype, op=op, accum=accum,
                                             segment_bytes=max_seg, num_slots=nslots, slot_bytes=slot_bytes,
                                             inputs=ins, seed=staging + seg)
            label = f"n={n} {dtype} staging={staging} seg={max_seg} slots={nslots}"
            assert rc == 0, f"{label}: {msg}"
            for got in outs[0]:
                assert same_bits(got, outs[0][0]), f"{label}: ranks differ"
            if seen is None:
                seen = outs[0][0]
            assert same_bits(outs[0][0], seen), f"{label}: other bits than another pipeline"


@pytest.mark.parametrize("lanes", [2, 3, 4])
def test_lanes_give_the_one_lane_bits(lib, lanes):
    """Note [Lanes]: lanes run side by side on their own simulated streams and communicators (random
    interleavings, race detector, back-to-back and async calls sharing the staging); on random data the
    result is bitwise the one-lane ring's on every rank, for float32, bf16 with float32 partials (lanes
    share the partials buffer), fp16 AVG, and float32 with a 16-bit wire and/or a predivide factor
    (each lane converts its own segments' first hop and shares the 16-bit partials buffer), which is
    also the ring's arithmetic reproduced in torch."""
    gen = torch.Generator().manual_seed(100 + lanes)
    for n, numel, dtype, op, accum, wire, factor in (
            (3, 2053, torch.float32, SUM, False, None, 0.0), (4, 1031, torch.bfloat16, AVG, True, None, 0.0),
            (2, 777, torch.float16, AVG, False, None, 0.0), (5, 4099, torch.float32, MAX, False, None, 0.0),
            (3, 2053, torch.float32, AVG, False, torch.bfloat16, 0.0),
            (4, 1031, torch.float32, SUM, False, torch.float16, 2.0),
            (2, 777, torch.float32, AVG, False, None, 3.0)):
        ins = [[(torch.randn(numel, generator=gen) * 100).to(dtype) for _ in range(n)] for _ in range(3)]
        kw = dict(nranks=n, numel=numel, dtype=dtype, op=op, accum=accum, segment_bytes=96, num_slots=2,
                  inputs=ins, ncalls=3, async_mask=0b010, wire=wire, predivide=factor)
        rc, msg, _, one = sim_allreduce(lib, seed=1, lanes=1, **kw)
        assert rc == 0, msg
        if wire is not None or factor:
            for c in range(3):
                assert same_bits(one[c][0], ring_emulation(ins[c], op, wire, factor)), f"n={n} {wire} call {c}"
        for seed in range(3):
            rc, msg, _, outs = sim_allreduce(lib, seed=seed, lanes=lanes, gather_into_data=seed != 1, **kw)
            label = f"{lanes} lanes n={n} {dtype} wire={wire} f={factor} seed {seed}"
            assert rc == 0, f"{label}: {msg}"
            for c in range(3):
                for got in outs[c]:
                    assert same_bits(got, one[c][0]), f"{label} call {c}: not the one-lane ring's bits"


def test_pipeline_rule_from_python(lib):
    """The rule's numbers as docs/algorithm.md states them: 8 MiB segments in 16 MiB of staging, 2 slots,
    one-shot thresholds 1 MiB (<= 4 ranks) / 256 KiB (<= 8) / 64 KiB; knobs override; bad knobs raise."""
    assert gpu_pipeline(lib, 2, (64 << 20) // 4, torch.float32)[:4] == (8 << 20, 2, 8 << 20, 1)
    # two lanes (the default communicator's): 4 MiB slots each, from 4 MiB chunks on
    assert gpu_pipeline(lib, 2, (64 << 20) // 4, torch.float32, max_lanes=2)[:4] == (4 << 20, 2, 4 << 20, 2)
    assert gpu_pipeline(lib, 2, (1 << 20) // 4, torch.float32, max_lanes=2)[3] == 1
    assert gpu_pipeline(lib, 2, (64 << 20) // 4, torch.float32, lanes=1, max_lanes=2)[3] == 1
    assert gpu_pipeline(lib, 8, 1 << 20, torch.float32)[4] == 256 << 10
    assert gpu_pipeline(lib, 2, 1, torch.float32)[4] == 1 << 20
    assert gpu_pipeline(lib, 4, 1, torch.float32)[4] == 1 << 20
    assert gpu_pipeline(lib, 16, 1, torch.float32)[4] == 64 << 10
    assert gpu_pipeline(lib, 2, 1 << 20, torch.float32, segment_bytes=4096, slots=4)[:2] == (4096, 4)
    out = (ctypes.c_longlong * 5)()
    err = ctypes.create_string_buffer(512)
    assert lib.rr_gpu_pipeline(2, 100, 0, 0, 16 << 20, 8, 0, 0, -1, 1, out, err, len(err)) != 0
    assert b"RINGREDUCE_SEGMENT_BYTES" in err.value


def sim_mixed(lib, *, nranks, dtype, op, inputs, one_shot_mask, accum=False, segment_bytes=64, num_slots=2,
              seed=1, fault=0, wire=None, predivide=0.0, extra_divisor=1):
    """Calls on one simulated device, call c a one-shot when bit c of one_shot_mask is set, else the ring,
    both with the same arithmetic (accum, a 16-bit `wire`, `predivide`, `extra_divisor`).
    inputs: [call][rank] tensors. Returns (rc, message, outputs [call][rank], hand-offs per rank)."""
    ncalls = len(inputs)
    numel = inputs[0][0].numel()
    flat_in = [t for call in inputs for t in call]
    outs = [torch.zeros(numel, dtype=dtype) for _ in flat_in]
    in_ptrs = (ctypes.c_void_p * len(flat_in))(*[t.data_ptr() for t in flat_in])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[t.data_ptr() for t in outs])
    hand_offs = (ctypes.c_int * nranks)()
    err = ctypes.create_string_buffer(8192)
    rc = lib.rr_sim_mixed(nranks, numel, DTYPES[dtype], op, int(accum), DTYPES[wire] if wire else -1,
                          float(predivide), int(extra_divisor), segment_bytes, num_slots,
                          max(256, segment_bytes * 4), ncalls, one_shot_mask, seed, fault, in_ptrs, out_ptrs, hand_offs,
                          err, len(err))
    return rc, err.value.decode(), [outs[c * nranks:(c + 1) * nranks] for c in range(ncalls)], list(hand_offs)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_one_shot_gives_the_rings_bits(lib, dtype):
    """Note [GPU one-shot all-reduce]: on random data, every op, 2-5 ranks, float32 partials or not, the
    one-shot's result is bitwise the ring's on every rank (so the threshold never changes a result),
    exact on exact data, and a one-shot call sits between ring calls on one device without a race."""
    gen = torch.Generator().manual_seed(240 + DTYPES[dtype])
    runs = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for nranks in (2, 3, 5):
            for accum in ((False, True) if dtype in HALF else (False,)):
                numel = 200 + 13 * nranks  # every chunk non-empty (int8 chunks are 16-element aligned)
                rand = [[random_values(dtype, numel, gen) for _ in range(nranks)] for _ in range(2)]
                if op == PRODUCT and dtype in FLOATING:  # keep products finite
                    rand = [[(t.double().clamp(-2, 2)).to(dtype) for t in call] for call in rand]
                exact = [exact_inputs(dtype, op, nranks, numel, 0)]
                # ring, one-shot, ring on random data; then one-shot on exact data
                calls = [rand[0], rand[0], rand[1], exact[0]]
                label = f"{op_name} {dtype} n={nranks} accum={accum}"
                rc, msg, outs, hand_offs = sim_mixed(lib, nranks=nranks, dtype=dtype, op=op, inputs=calls,
                                                     one_shot_mask=0b1010, accum=accum,
                                                     seed=nranks + 7 * op + runs)
                assert rc == 0, f"{label}: {msg}"
                for r in range(nranks):
                    assert same_bits(outs[1][r], outs[0][0]), f"{label}: one-shot rank {r} differs from the ring"
                    assert same_bits(outs[0][r], outs[0][0]), f"{label}: ring ranks differ"
                    assert same_bits(outs[3][r], expected(dtype, op, exact[0])), f"{label}: one-shot on exact data"
                # one hand-off per call: the ring's first exchange, the one-shot's group
                assert hand_offs == [4] * nranks, f"{label}: hand-offs {hand_offs}"
                runs += 1
    assert runs > 0


def test_one_shot_gives_the_rings_bits_with_a_wire_and_scaling(lib):
    """Note [GPU one-shot all-reduce] with issue 25's arithmetic: a 16-bit wire (bf16, fp16; rounded per
    hop, float32 final), predivide factors and an extra divisor (GradientAverager's accumulation steps),
    also on a bf16 tensor with float32 partials: on random data the one-shot gives bitwise the ring's
    result on every rank, for SUM and AVG on 2, 3 and 5 ranks, and both equal the ring's arithmetic
    reproduced in torch (ring_emulation) where it covers the case."""
    gen = torch.Generator().manual_seed(2425)
    cases = [(torch.float32, False, wire, factor, steps) for wire in (torch.bfloat16, torch.float16)
             for factor, steps in ((0.0, 1), (3.0, 1), (0.0, 4), (2.0, 3))]
    cases += [(torch.float32, False, None, 3.0, 1), (torch.float32, False, None, 0.0, 4),
              (torch.bfloat16, True, None, 2.0, 1), (torch.float16, False, None, 4.0, 2)]
    runs = 0
    for dtype, accum, wire, factor, steps in cases:
        for op in (SUM, AVG):
            for nranks in (2, 3, 5):
                numel = 200 + 13 * nranks
                rand = [[(torch.randn(numel, generator=gen) * (r + 1)).to(dtype) for r in range(nranks)]
                        for _ in range(2)]
                # ring, one-shot, one-shot, ring: the one-shot between ring calls on one device
                calls = [rand[0], rand[0], rand[1], rand[1]]
                label = f"{dtype} op={op} n={nranks} accum={accum} wire={wire} f={factor} steps={steps}"
                rc, msg, outs, _ = sim_mixed(lib, nranks=nranks, dtype=dtype, op=op, inputs=calls,
                                             one_shot_mask=0b0110, accum=accum, wire=wire, predivide=factor,
                                             extra_divisor=steps, seed=nranks + op + runs)
                assert rc == 0, f"{label}: {msg}"
                for r in range(nranks):
                    assert same_bits(outs[1][r], outs[0][0]), f"{label}: one-shot rank {r} differs from the ring"
                    assert same_bits(outs[2][r], outs[3][0]), f"{label}: one-shot rank {r} differs from the ring"
                    assert same_bits(outs[0][r], outs[0][0]) and same_bits(outs[3][r], outs[3][0]), label
                if dtype == torch.float32 and steps == 1:
                    want = ring_emulation(rand[0], op, wire, factor)
                    assert same_bits(outs[1][0], want), f"{label}: not the ring's arithmetic"
                runs += 1
    assert runs == 2 * 3 * len(cases)


def test_one_shot_race_detector_and_faults(lib):
    """The simulator must catch a one-shot whose reduce writes off by one element or whose caller does
    not wait; a clean one-shot next to ring calls, async-free, passes on many schedules."""
    gen = torch.Generator().manual_seed(7)
    ins = [[torch.randn(301, generator=gen) for _ in range(3)] for _ in range(3)]
    for seed in range(10):
        rc, msg, _, _ = sim_mixed(lib, nranks=3, dtype=torch.float32, op=SUM, inputs=ins, one_shot_mask=0b101,
                                  seed=seed)
        assert rc == 0, msg
    for fault in (2, 4, 5):
        caught = 0
        for seed in range(4):
            rc, msg, outs, _ = sim_mixed(lib, nranks=3, dtype=torch.float32, op=SUM, inputs=ins[:1],
                                         one_shot_mask=0b1, seed=seed, fault=fault)
            caught += int(rc != 0 or any(not same_bits(o, outs[0][0]) for o in outs[0]) or
                          not torch.allclose(outs[0][0], torch.stack(ins[0]).sum(0), atol=1e-4))
        assert caught == 4, f"fault {fault} went unnoticed in {4 - caught} of 4 schedules"


# ---------------------------------------------------------------------------------------------
# The direct all-reduce (Note [Direct all-reduce], csrc/core/direct.h; Note [Direct rounds on
# streams], csrc/cuda/direct_executor.h) on the simulated device


def sim_direct(lib, *, inputs, op, one_shot_mask=0, narrow=False, wire=None, predivide=0.0, extra_divisor=1,
               segment_bytes=64, staging_bytes=4096, seed=1, fault=0):
    """Direct all-reduces back to back (call c the direct one-shot when bit c of one_shot_mask is set);
    inputs: [call][rank]. Returns (rc, message, outputs [call][rank], hand-offs per rank)."""
    ncalls, nranks = len(inputs), len(inputs[0])
    numel, dtype = inputs[0][0].numel(), inputs[0][0].dtype
    flat_in = [t for call in inputs for t in call]
    outs = [torch.zeros(numel, dtype=dtype) for _ in flat_in]
    in_ptrs = (ctypes.c_void_p * len(flat_in))(*[t.data_ptr() for t in flat_in])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[t.data_ptr() for t in outs])
    hand_offs = (ctypes.c_int * nranks)()
    err = ctypes.create_string_buffer(8192)
    args = SimDirect(nranks, numel, DTYPES[dtype], op, int(narrow), DTYPES[wire] if wire else -1, float(predivide),
                     int(extra_divisor), segment_bytes, staging_bytes, ncalls, one_shot_mask, seed, fault)
    rc = lib.rr_sim_direct(ctypes.byref(args), in_ptrs, out_ptrs, hand_offs, err, len(err))
    return rc, err.value.decode(), [outs[c * nranks:(c + 1) * nranks] for c in range(ncalls)], list(hand_offs)


def direct_emulation(inputs, op, wire=None, factor=0.0, narrow=False):
    """Note [Direct all-reduce] in torch ops: each contribution divided by `factor` (rounded to the
    dtype; with a 16-bit `wire`, then rounded to it), added in rank order in float32 (float64 for
    float64; rounded to the dtype after every step when `narrow`), the sum scaled once and rounded."""
    dtype, n = inputs[0].dtype, len(inputs)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    f = torch.tensor(factor, dtype=acc) if factor else None

    def enter(x):
        c = (x.to(acc) / f).to(dtype) if f is not None else x
        return c.to(wire).to(acc) if wire is not None else c.to(acc)

    p = enter(inputs[0])
    for x in inputs[1:]:
        p = enter(x) + p
        if narrow:
            p = p.to(dtype).to(acc)
    if op == AVG:
        q = torch.tensor(float(n), dtype=acc)
        p = p / (q / f if f is not None else q)
    elif f is not None:
        p = p * f
    return p.to(dtype)


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_sim_direct_exact(lib, dtype):
    """Every dtype and op, 2-5 ranks, counts around the chunk edges, tiny segments and staging (many
    rounds, two in flight), the direct one-shot beside the exchange: the float64 reference, bitwise."""
    runs = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for nranks in (2, 3, 5):
            for numel in (1, nranks - 1, nranks + 1, 37, 203):
                if numel <= 0:
                    continue
                ins = [exact_inputs(dtype, op, nranks, numel, c) for c in range(2)]
                rc, msg, outs, _ = sim_direct(lib, inputs=ins, op=op, one_shot_mask=0b10, seed=numel + nranks,
                                              segment_bytes=16 if numel < 100 else 48, staging_bytes=2048)
                label = f"{op_name} {dtype} n={nranks} numel={numel}"
                assert rc == 0, f"{label}: {msg}"
                check_results(dtype, op, ins, outs, label)
                runs += 1
    assert runs > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_sim_direct_is_the_rank_order(lib, dtype):
    """Random data under random stream schedules: bitwise the rank order reproduced in torch (half types
    in float32, rounded once; narrow: rounded per step; a float32 tensor's 16-bit wire rounding each
    contribution), the one-shot giving the exchange's bits, every rank the same."""
    gen = torch.Generator().manual_seed(3)
    wires = (None, torch.bfloat16, torch.float16) if dtype == torch.float32 else (None,)
    for n in (2, 3, 4):
        for wire in wires:
            for op, factor, narrow in ((SUM, 0.0, False), (AVG, 0.0, False), (AVG, 4.0, False), (SUM, 0.0, True)):
                if narrow and dtype not in HALF:
                    continue
                numel = 1001
                ins = [[(torch.randn(numel, generator=gen) * (r + 1)).to(dtype) for r in range(n)] for _ in range(3)]
                mask = 0b010 if wire is None else 0  # a wire's pieces: never the one-shot (it moves the tensors)
                rc, msg, outs, hand_offs = sim_direct(lib, inputs=ins, op=op, one_shot_mask=mask, narrow=narrow,
                                                      wire=wire, predivide=factor, segment_bytes=96,
                                                      staging_bytes=4096, seed=n * 7 + int(factor))
                label = f"{dtype} n={n} op={op} wire={wire} f={factor} narrow={narrow}"
                assert rc == 0, f"{label}: {msg}"
                assert hand_offs == [len(ins)] * n, f"{label}: hand-offs {hand_offs}"  # one per call
                for c, call in enumerate(ins):
                    want = direct_emulation(call, op, wire, factor, narrow)
                    for r, got in enumerate(outs[c]):
                        assert same_bits(got, want), f"{label} call {c} rank {r}: {int((got != want).sum())} off"


DIRECT_FAULTS = {
    2: "the call does not wait for the caller's stream",
    3: "the first plan wait on kCompute is dropped",
    4: "one reduce writes one element off",
    5: "the caller does not wait for the call",
}


@pytest.mark.parametrize("fault", sorted(DIRECT_FAULTS))
def test_sim_direct_catches_broken_driver(lib, fault):
    """Each deliberately broken interpreter decision fails the direct exchange too (else the simulator
    proves nothing about it): a race, a wrong element or a caller reading early."""
    gen = torch.Generator().manual_seed(8)
    ins = [[torch.randn(301, generator=gen) for _ in range(3)]]
    caught = 0
    for seed in range(4):
        rc, _, outs, _ = sim_direct(lib, inputs=ins, op=SUM, seed=seed, fault=fault, segment_bytes=64,
                                    staging_bytes=1024)
        want = direct_emulation(ins[0], SUM)
        caught += int(rc != 0 or any(not same_bits(o, want) for o in outs[0]))
    assert caught == 4, f"fault {fault} ({DIRECT_FAULTS[fault]}) went unnoticed in {4 - caught} of 4 schedules"


def ring_emulation(inputs, op, wire=None, factor=0.0):
    """The flat ring's arithmetic on float32 inputs (Note [Reduction contract]): chunk c (16-byte
    aligned chunks) takes rank c's value first; each value enters divided by `factor`; partials are
    rounded to `wire` per hop; the finished sum is scaled once."""
    n, numel = len(inputs), inputs[0].numel()
    chunk = (numel + n - 1) // n
    chunk = (chunk + 3) // 4 * 4  # ceil(numel / n) rounded up to 16 bytes of float32
    f = torch.tensor(factor, dtype=torch.float32) if factor else None
    out = torch.empty(numel)
    for c in range(n):
        b, e = min(c * chunk, numel), min((c + 1) * chunk, numel)
        if b >= e:
            continue
        xs = [(inputs[(c + j) % n][b:e] / f) if f is not None else inputs[(c + j) % n][b:e] for j in range(n)]
        p = xs[0].to(wire) if wire else xs[0]
        for k in range(1, n):
            s = xs[k] + p.float()
            p = s.to(wire) if (wire and k < n - 1) else s
        if op == AVG:
            q = torch.tensor(float(n))
            p = p / (q / f if f is not None else q)
        elif f is not None:
            p = p * f
        out[b:e] = p
    return out


@pytest.mark.parametrize("wire", [None, torch.bfloat16, torch.float16], ids=["none", "bf16", "fp16"])
def test_sim_driver_wire_and_predivide(lib, wire):
    """The GPU driver's plan with 16-bit partials and/or a predivide factor (converts on kCompute,
    16-bit exchanges, float32 all-gather), under random stream schedules: bitwise the ring's
    arithmetic reproduced in torch, identical on every rank."""
    gen = torch.Generator().manual_seed(21)
    for n in (2, 3, 5):
        for numel in (1, n + 1, 301):
            for op, factor in ((SUM, 0.0), (AVG, 0.0), (AVG, 3.0), (SUM, 2.0)):
                if wire is None and not factor:
                    continue
                ins = [[torch.randn(numel, generator=gen) * (r + 1) for r in range(n)]]
                rc, msg, _, outs = sim_allreduce(lib, nranks=n, numel=numel, dtype=torch.float32, op=op,
                                                 segment_bytes=32, num_slots=3, inputs=ins, seed=numel + n,
                                                 data_offset=numel % 3, wire=wire, predivide=factor,
                                                 gather_into_data=numel % 2 == 1)
                label = f"n={n} numel={numel} op={op} wire={wire} f={factor}"
                assert rc == 0, f"{label}: {msg}"
                want = ring_emulation(ins[0], op, wire, factor)
                for got in outs[0]:
                    assert same_bits(got, want), f"{label}:\ngot  {got}\nwant {want}"


FAULTS = {
    # With gather_into_data (the GPU plan) the all-gather's sends already order kComm after every
    # staging read, so the previous-call wait is defense in depth there; it is required for
    # plans that read staging in the all-gather (the CPU shape), which is what this case runs.
    1: "kComm skips the previous call's done event",
    2: "the call does not wait for the caller's stream",
    3: "the first plan wait on kCompute is dropped",
    4: "one reduce writes one element off",
    5: "the caller does not wait for the call",
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_sim_catches_broken_driver(lib, fault):
    """The simulator must fail each deliberately broken interpreter decision (else it proves nothing)."""
    caught = 0
    for seed in range(4):
        rc, msg, ins, outs = sim_allreduce(lib, nranks=3, numel=97, dtype=torch.float32, op=SUM, segment_bytes=16,
                                           num_slots=2, ncalls=2, async_mask=0b11 if fault == 1 else 0, seed=seed,
                                           fault=fault, gather_into_data=fault != 1)
        if rc != 0:
            assert msg, "a failure must carry a message"
            caught += 1
            continue
        wrong = any(not same_bits(g, expected(torch.float32, SUM, ins[c]))
                    for c in range(len(ins)) for g in outs[c])
        caught += int(wrong)
    assert caught == 4, f"fault {fault} ({FAULTS[fault]}) went unnoticed in {4 - caught} of 4 schedules"


def test_sim_data_race_message_names_ops(lib):
    rc, msg, _, _ = sim_allreduce(lib, nranks=2, numel=64, dtype=torch.float32, op=SUM, segment_bytes=16,
                                  fault=2, seed=0)
    assert rc != 0 and "data race" in msg and "producer" in msg


# ---------------------------------------------------------------------------------------------
# The other collectives' stages: ring halves, AVG divisor, rank-mapped rings, hierarchical

MODE_FLAT, MODE_REDUCE_SCATTER, MODE_ALL_GATHER, MODE_HIERARCHICAL = range(4)


def sim_ring(lib, *, comm_size, rings, mode, numel, dtype, op, local_size=0, accum=False, segment_bytes=48,
             num_slots=3, slot_bytes=None, avg_divisor=0, ncalls=1, seed=1, fault=0, inputs=None, wire=None,
             predivide=0.0):
    """Runs `ncalls` calls on the rings `rings` (lists of communicator ranks, one size) side by side.

    Returns (rc, message, inputs[c][k][i], outputs[c][k][i], peers) where peers[r] = (set of ranks r
    sent to, set of ranks r received from).
    """
    ring_size = len(rings[0])
    assert all(len(r) == ring_size for r in rings)
    if slot_bytes is None:
        slot_bytes = max(256, segment_bytes * 4)
    if inputs is None:
        inputs = []
        for c in range(ncalls):
            per_ring = []
            for k in range(len(rings)):
                per_ring.append(exact_inputs(dtype, op, ring_size, numel, c + 3 * k))
            inputs.append(per_ring)
    flat_in = [t for call in inputs for ring in call for t in ring]
    outs = [torch.zeros(numel, dtype=dtype) for _ in flat_in]
    members = [m for ring in rings for m in ring]
    c_members = (ctypes.c_int * len(members))(*members)
    in_ptrs = (ctypes.c_void_p * len(flat_in))(*[t.data_ptr() for t in flat_in])
    out_ptrs = (ctypes.c_void_p * len(outs))(*[t.data_ptr() for t in outs])
    peers_buf = (ctypes.c_int * (comm_size * 16))()
    err = ctypes.create_string_buffer(8192)
    rc = lib.rr_sim_ring(comm_size, len(rings), ring_size, c_members, mode, local_size, numel, DTYPES[dtype], op,
                         int(accum), DTYPES[wire] if wire else -1, float(predivide), segment_bytes, num_slots,
                         slot_bytes, avg_divisor, ncalls, seed, fault, in_ptrs,
                         out_ptrs, peers_buf, err, len(err))
    it = iter(outs)
    results = [[[next(it) for _ in range(ring_size)] for _ in rings] for _ in range(ncalls)]
    peers = {}
    for r in range(comm_size):
        row = list(peers_buf[r * 16 : (r + 1) * 16])
        peers[r] = ({p for p in row[:8] if p >= 0}, {p for p in row[8:] if p >= 0})
    return rc, err.value.decode(), inputs, results, peers


def blocks(t, n):
    return list(t.view(n, -1))


def ring_neighbours(ring, i):
    m = len(ring)
    return ring[(i + 1) % m], ring[(i - 1) % m]


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_sim_reduce_scatter_exact(lib, dtype):
    """Reduce-scatter only (owner shift -1, exact blocks): ring index i ends with block i reduced."""
    runs = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for rings, comm in (([[0, 1]], 2), ([[0, 1, 2]], 3), ([[2, 0, 4, 1, 3]], 5)):
            n = len(rings[0])
            for blk in (1, 7, 33):
                rc, msg, ins, outs, _ = sim_ring(lib, comm_size=comm, rings=rings, mode=MODE_REDUCE_SCATTER,
                                                 numel=n * blk, dtype=dtype, op=op, segment_bytes=16,
                                                 seed=blk + 7 * n + op)
                label = f"{op_name} {dtype} ring={rings[0]} blk={blk}"
                assert rc == 0, f"{label}: {msg}"
                want = blocks(expected(dtype, op, ins[0][0]), n)
                for i, got in enumerate(outs[0][0]):
                    assert same_bits(blocks(got, n)[i], want[i]), f"{label} index {i}"
                runs += 1
    assert runs > 0


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_sim_all_gather_exact(lib, dtype):
    """All-gather only: ring index i starts with its own block (and garbage), ends with every block."""
    gen = torch.Generator().manual_seed(DTYPES[dtype])
    for rings, comm in (([[0, 1]], 2), ([[1, 2, 0]], 3), ([[4, 0, 3, 1]], 5)):
        n = len(rings[0])
        for blk in (1, 5, 40):
            own = exact_inputs(dtype, SUM, n, blk, 0)
            ins = []
            for i in range(n):
                raw = torch.randint(0, 256, (n * blk * own[0].element_size(),), generator=gen, dtype=torch.uint8)
                t = raw.view(dtype).clone()  # garbage everywhere ...
                blocks(t, n)[i].copy_(own[i])  # ... but in its own block
                ins.append(t)
            rc, msg, _, outs, _ = sim_ring(lib, comm_size=comm, rings=rings, mode=MODE_ALL_GATHER, numel=n * blk,
                                           dtype=dtype, op=SUM, segment_bytes=16, seed=blk, inputs=[[ins]])
            assert rc == 0, msg
            want = torch.cat(own)
            for i, got in enumerate(outs[0][0]):
                assert same_bits(got, want), f"{dtype} ring={rings[0]} blk={blk} index {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64],
                         ids=lambda d: str(d).replace("torch.", ""))
def test_sim_avg_divisor(lib, dtype):
    """A full ring whose AVG divides by a larger count (the hierarchical cross-node stage)."""
    for n in (2, 3, 4):
        for numel in (1, n + 1, 203):
            divisor = 3 * n + 1
            rc, msg, ins, outs, _ = sim_ring(lib, comm_size=n, rings=[list(range(n))], mode=MODE_FLAT, numel=numel,
                                             dtype=dtype, op=AVG, avg_divisor=divisor, seed=numel)
            assert rc == 0, msg
            want = expected(dtype, AVG, ins[0][0], divisor=divisor)
            for got in outs[0][0]:
                assert same_bits(got, want), f"{dtype} n={n} numel={numel}"


@pytest.mark.parametrize("mode", [MODE_FLAT, MODE_REDUCE_SCATTER, MODE_ALL_GATHER], ids=["flat", "rs", "ag"])
def test_sim_rank_mapped_rings_use_mapped_peers(lib, mode):
    """Two rings over scrambled rank lists of one 7-rank communicator, side by side: exact results,
    and every exchange of ring index i talks to communicator ranks members[i +- 1] only."""
    rings = [[4, 1, 6], [0, 5, 2]]
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for seed in range(4):
            numel = 3 * (5 + 11 * seed)
            rc, msg, ins, outs, peers = sim_ring(lib, comm_size=7, rings=rings, mode=mode, numel=numel, dtype=dtype,
                                                 op=SUM, segment_bytes=16, num_slots=2, ncalls=2, seed=seed)
            assert rc == 0, msg
            for c in range(2):
                for k, ring in enumerate(rings):
                    if mode == MODE_ALL_GATHER:
                        want_full = torch.cat([blocks(ins[c][k][i], 3)[i] for i in range(3)])
                    else:
                        want_full = expected(dtype, SUM, ins[c][k])
                    for i, got in enumerate(outs[c][k]):
                        if mode == MODE_REDUCE_SCATTER:
                            assert same_bits(blocks(got, 3)[i], blocks(want_full, 3)[i])
                        else:
                            assert same_bits(got, want_full), f"call {c} ring {ring} index {i}"
            for ring in rings:
                for i, r in enumerate(ring):
                    nxt, prv = ring_neighbours(ring, i)
                    assert peers[r] == ({nxt}, {prv}), f"rank {r} of ring {ring}: peers {peers[r]}"
            assert peers[3] == (set(), set()), "rank 3 is in no ring and must not communicate"


def _hier_peers(members, local_size, i):
    n = len(members)
    m = n // local_size
    node, local = divmod(i, local_size)
    intra = [members[node * local_size + j] for j in range(local_size)]
    inter = [members[k * local_size + local] for k in range(m)]
    sends = {ring_neighbours(intra, local)[0], ring_neighbours(inter, node)[0]}
    recvs = {ring_neighbours(intra, local)[1], ring_neighbours(inter, node)[1]}
    return sends, recvs


HIER_LAYOUTS = [
    # (communicator size, members ordered node by node, ranks per node)
    (4, [0, 1, 2, 3], 2),
    (6, [3, 0, 5, 1, 4, 2], 2),
    (6, [3, 0, 5, 1, 4, 2], 3),
    (8, [0, 1, 2, 3, 4, 5, 6, 7], 4),
    (8, [6, 2, 7, 3, 0, 4, 1, 5], 2),
]


@pytest.mark.parametrize("dtype", SWEEP_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_sim_hierarchical_exact(lib, dtype):
    """The three stages (intra-node reduce-scatter, cross-node ring on the owned range with AVG
    dividing by the whole ring, intra-node all-gather) equal the flat reduction bit for bit on
    exact data, for every dtype and op; each rank talks only to its node and cross-node neighbours."""
    runs = 0
    for op_name, op in OPS.items():
        if not supported(dtype, op):
            continue
        for comm, members, local in HIER_LAYOUTS:
            for numel in (1, comm - 1, comm + 3, 203):
                rc, msg, ins, outs, peers = sim_ring(lib, comm_size=comm, rings=[members], mode=MODE_HIERARCHICAL,
                                                     local_size=local, numel=numel, dtype=dtype, op=op,
                                                     segment_bytes=16 if numel < 100 else 48, num_slots=2 + numel % 2,
                                                     seed=numel + 13 * op + comm)
                label = f"{op_name} {dtype} members={members} L={local} numel={numel}"
                assert rc == 0, f"{label}: {msg}"
                check_results(dtype, op, ins[0], outs[0], label)
                for i, r in enumerate(members):
                    sends, recvs = _hier_peers(members, local, i)
                    assert peers[r][0] <= sends and peers[r][1] <= recvs, f"{label}: rank {r} peers {peers[r]}"
                    if numel >= 2 * comm:
                        assert peers[r] == (sends, recvs), f"{label}: rank {r} peers {peers[r]}"
                runs += 1
    assert runs > 0


def test_sim_hierarchical_predivide(lib):
    """A predivide factor through the hierarchical stages: every contribution divided once in the node
    ring, the finished sum scaled once in the cross-node ring (exact data, dyadic factors: equal to
    the flat reduction); the driver refuses a 16-bit wire there."""
    for comm, members, local in HIER_LAYOUTS:
        for op, f in ((AVG, 2.0), (SUM, 4.0), (AVG, 0.5)):
            for dtype in (torch.float32, torch.bfloat16):
                rc, msg, ins, outs, _ = sim_ring(lib, comm_size=comm, rings=[members], mode=MODE_HIERARCHICAL,
                                                 local_size=local, numel=203, dtype=dtype, op=op, segment_bytes=48,
                                                 seed=7 + comm, predivide=f)
                label = f"members={members} L={local} op={op} f={f} {dtype}"
                assert rc == 0, f"{label}: {msg}"
                check_results(dtype, op, ins[0], outs[0], label)
    comm, members, local = HIER_LAYOUTS[0]
    rc, msg, *_ = sim_ring(lib, comm_size=comm, rings=[members], mode=MODE_HIERARCHICAL, local_size=local,
                           numel=64, dtype=torch.float32, op=AVG, wire=torch.bfloat16)
    assert rc != 0 and "flat ring" in msg


def test_sim_hierarchical_back_to_back_and_random_data(lib):
    """Several hierarchical calls in a row share staging and events; random float32 data agrees
    with the float64 truth within tolerance and is identical on every rank."""
    gen = torch.Generator().manual_seed(3)
    members, local, n = [6, 2, 7, 3, 0, 4, 1, 5], 2, 8
    for seed in range(6):
        rc, msg, ins, outs, _ = sim_ring(lib, comm_size=n, rings=[members], mode=MODE_HIERARCHICAL, local_size=local,
                                         numel=301, dtype=torch.float32, op=SUM, segment_bytes=32, num_slots=2,
                                         ncalls=3, seed=seed)
        assert rc == 0, f"seed {seed}: {msg}"
        for c in range(3):
            check_results(torch.float32, SUM, ins[c], outs[c], f"seed {seed} call {c}")
    ins = [[[torch.randn(1000, generator=gen) for _ in range(n)]]]
    rc, msg, _, outs, _ = sim_ring(lib, comm_size=n, rings=[members], mode=MODE_HIERARCHICAL, local_size=local,
                                   numel=1000, dtype=torch.float32, op=AVG, inputs=ins, seed=9)
    assert rc == 0, msg
    truth = torch.stack(ins[0][0]).double().mean(0)
    for got in outs[0][0]:
        torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-6)
        assert same_bits(got, outs[0][0][0])


def test_sim_hierarchical_refuses_uneven_nodes(lib):
    rc, msg, _, _, _ = sim_ring(lib, comm_size=6, rings=[list(range(6))], mode=MODE_HIERARCHICAL, local_size=4,
                                numel=10, dtype=torch.float32, op=SUM)
    assert rc != 0 and "equal nodes" in msg


STAGE_FAULTS = {
    6: "kComm does not wait for the previous stage",
    7: "exchanges ignore the ring's members (peers r +- 1 of the communicator)",
}


@pytest.mark.parametrize("fault", sorted(STAGE_FAULTS))
def test_sim_catches_broken_stage_driver(lib, fault):
    """Both new interpreter decisions are load-bearing: breaking either fails every schedule."""
    caught = 0
    for seed in range(4):
        if fault == 6:
            kw = dict(comm_size=6, rings=[[3, 0, 5, 1, 4, 2]], mode=MODE_HIERARCHICAL, local_size=2, numel=97)
        else:
            kw = dict(comm_size=7, rings=[[4, 1, 6], [0, 5, 2]], mode=MODE_FLAT, numel=48)
        rc, msg, ins, outs, _ = sim_ring(lib, dtype=torch.float32, op=SUM, segment_bytes=16, num_slots=2, seed=seed,
                                         fault=fault, **kw)
        if rc != 0:
            assert msg
            caught += 1
            continue
        caught += int(any(not same_bits(g, expected(torch.float32, SUM, ins[0][k])) for k in range(len(kw["rings"]))
                          for g in outs[0][k]))
    assert caught == 4, f"fault {fault} ({STAGE_FAULTS[fault]}) went unnoticed in {4 - caught} of 4 schedules"


# ---- scripts/gpu_review_checks.py: the GPU review's checks that need a GPU -------------------------

REVIEW_CHECKS = ROOT / "scripts" / "gpu_review_checks.py"


def _review_checks_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_review_checks", REVIEW_CHECKS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.full  # the GPU checks' script, not the library (tests/README.md, "The default run")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the checks would run")
def test_gpu_review_checks_without_a_gpu_say_so_and_exit_0():
    import sys

    listed = subprocess.run([sys.executable, str(REVIEW_CHECKS), "--list"], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    names = [row[0] for row in rows]
    assert {"nccl-version", "lanes-stop", "env-blocking", "env-split-share", "launch-order", "fallback"} <= set(names)
    assert all(row[1] == "<=" and 0 < int(row[2]) <= 60 for row in rows), listed.stdout
    run = subprocess.run([sys.executable, str(REVIEW_CHECKS), "all"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"{n} SKIP: needs a CUDA GPU (none here)" for n in names]
    bad = subprocess.run([sys.executable, str(REVIEW_CHECKS), "no-such-check"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no-such-check" in bad.stderr


def test_gpu_review_checks_verdicts():
    """The one-line verdicts from what the ranks reported (no GPU needed)."""
    mod = _review_checks_module()
    hang = mod.verdict("lanes-stop", [None, None], ["", ""], 60.0, 60)
    assert hang[0] == "FAIL" and "hang" in hang[1]
    raised = mod.verdict("lanes-stop", [{"rank": 0, "error": "DistBackendError: timed out", "seconds": 11.0}, None],
                         ["", ""], 12.0, 60)
    assert raised == ("PASS", "rank 0 after 11.0 s: DistBackendError: timed out")
    assert mod.verdict("lanes-stop", [{"rank": 0, "error": "no error", "seconds": 1.0}, None], ["", ""], 1.0,
                       60)[0] == "FAIL"
    refused = [{"rank": r, "error": "ValueError: ringreduce: NCCL_COMM_BLOCKING=1 is set", "nccl": "2.27.5"}
               for r in range(2)]
    assert mod.verdict("env-blocking", refused, ["", ""], 9.0, 45)[0] == "PASS"
    accepted = [{"rank": r, "mismatch": "", "nccl": "2.27.5"} for r in range(2)]
    assert mod.verdict("env-blocking", accepted, ["", ""], 9.0, 45)[0] == "FAIL"
    wrong = [{"rank": 0, "mismatch": "3 of 1024 elements differ", "nccl": "2.27.5"}, accepted[1]]
    status, seen = mod.verdict("launch-order", wrong, ["", ""], 9.0, 45)
    assert status == "FAIL" and "rank 0: 3 of 1024" in seen
    assert mod.verdict("launch-order", accepted, ["", ""], 9.0, 45)[0] == "PASS"
    one_lane = [{"rank": r, "mismatch": "", "lanes": 1, "nccl": "2.21.5"} for r in range(2)]
    assert mod.verdict("fallback", one_lane, ["", ""], 9.0, 45)[0] == "PASS"
    two_lanes = [{"rank": r, "mismatch": "", "lanes": 2, "nccl": "2.27.5"} for r in range(2)]
    assert mod.verdict("fallback", two_lanes, ["", ""], 9.0, 45)[0] == "FAIL"
    assert mod.verdict("nccl-version", [None, accepted[1]], ["boom", ""], 45.0, 45)[0] == "FAIL"
    simple = mod.verdict("nccl-version", one_lane, ["... take the simplest path ...", ""], 9.0, 45)
    assert simple[0] == "PASS" and "NCCL 2.21.5" in simple[1] and "simplest path" in simple[1]


def test_gpu_review_checks_rank_env_without_a_gpu():
    """Each rank's environment is built before any GPU is touched: a rank sharing one GPU gets its own
    NCCL_HOSTID (the import it needs once broke only on a GPU machine)."""
    mod = _review_checks_module()
    envs = [mod._rank_env(r, {"RINGREDUCE_LANES": "2"}, 1) for r in range(2)]
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["RINGREDUCE_LANES"] == "2" and e["PYTHONPATH"].startswith(str(mod.ROOT)) for e in envs)
