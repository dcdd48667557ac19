"""The CUDA+NCCL half of ringreduce._C, checked where it can be: it was built, it loads, it reports
its versions, and on a machine without a GPU its failures surface as the documented Python
exceptions (DistBackendError with CUDA's error string), never as a crash or a hang.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from ringreduce._native import C

cuda_build = pytest.mark.skipif(not rr.build_info()["cuda"], reason="ringreduce was built without CUDA")


@cuda_build
def test_build_info_reports_nccl_and_archs():
    info = rr.build_info()
    assert info["cuda"] is True
    major, minor, patch = (int(x) for x in info["nccl_version"].split("."))
    assert (major, minor) >= (2, 18)
    assert info["nccl_runtime_version"], "libnccl.so.2 must load (it needs no GPU)"
    assert info["cuda_archs"], "the CUDA architectures the kernels were built for"
    for name in ("nccl_unique_id", "CudaRing", "cuda_all_reduce", "cuda_ring_half", "CudaWorkHandle", "cuda_refuse",
                 "_cuda_loopback_all_reduce"):
        assert hasattr(C, name), name


@cuda_build
def test_nccl_unique_id_is_bytes():
    try:
        uid = C.nccl_unique_id()
    except dist.DistBackendError as exc:  # no usable network interface for NCCL's bootstrap
        pytest.skip(f"ncclGetUniqueId unavailable here: {exc}")
    assert isinstance(uid, bytes) and len(uid) == 128
    with pytest.raises(ValueError, match="128 bytes"):
        C.CudaRing(b"short", 2, 0, 0, 1000, "bad id")


@cuda_build
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_communicator_without_gpu_raises_dist_backend_error():
    from ringreduce._groups import resolve
    from ringreduce._rings import cuda as _cuda

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        try:
            info = resolve(None)
            try:
                C.nccl_unique_id()
            except dist.DistBackendError:
                pytest.skip("ncclGetUniqueId unavailable here")
            with pytest.raises(dist.DistBackendError, match=r"CUDA call .* failed|NCCL call .* failed"):
                _cuda.communicator(info, torch.device("cuda", 0))
            with pytest.raises(ValueError):
                _cuda.communicator(info, torch.device("cpu"))
        finally:
            dist.destroy_process_group()
