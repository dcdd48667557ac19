"""Training-loop integrations on CUDA: GradientAverager and DDP + ddp_comm_hook against DDP itself,
with and without a 16-bit wire, and all_reduce_coalesced with all_reduce's options. Needs a CUDA
GPU (ranks may share it, Note [Ranks sharing a GPU]). The bodies take `on_cuda` so that
tests/tools/test_gpu_harness.py runs them on CPU ranks too: what they assert holds there, and a GPU run
finds a ringreduce bug, not a test bug.

What ran on a GPU so far is listed in docs/design.md (Status).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from refdata import bits_equal, same_on_all_ranks

from gpu.gpu_ranks import device, need_gpus, run_gpu_ranks

pytestmark = [pytest.mark.gpu, need_gpus(1)]


def _model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank and for every copy
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)


def _ddp(model: torch.nn.Module, dev: torch.device) -> torch.nn.parallel.DistributedDataParallel:
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def _train(models: list[torch.nn.Module], dev: torch.device, rank: int, steps: int = 3,
           after_backward=None) -> None:
    """SGD steps of every model on the same per-rank batches."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    gen = torch.Generator().manual_seed(1234 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen).to(dev)
        y = torch.randn(16, 8, generator=gen).to(dev)
        for m, opt in zip(models, opts, strict=True):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(m(x), y).backward()
            if after_backward is not None:
                after_backward(m)
            opt.step()


def _hooks_match_ddp(rank: int, n: int, on_cuda: bool = True) -> int:
    """GradientAverager and DDP + rr.ddp_comm_hook give DDP's parameters after 3 SGD steps (within
    float32 rounding: DDP sums then divides, ringreduce divides the complete sum once), the same
    bits on every rank; with a bfloat16 wire (GradientAverager(wire_dtype=...) and
    rr.CommHookState(wire_dtype=...)) within the wire's rounding of DDP's, again identical on every
    rank."""
    import ringreduce as rr

    dev = device(rank) if on_cuda else torch.device("cpu")
    ref_model = _model(dev)
    ddp = _ddp(ref_model, dev)
    averaged = _model(dev)
    averager = rr.GradientAverager(averaged)
    hooked_model = _model(dev)
    hooked = _ddp(hooked_model, dev)
    hooked.register_comm_hook(state=None, hook=rr.ddp_comm_hook)
    wired = _model(dev)
    wired_averager = rr.GradientAverager(wired, wire_dtype=torch.bfloat16)
    wired_hook_model = _model(dev)
    wired_hooked = _ddp(wired_hook_model, dev)
    wired_hooked.register_comm_hook(rr.CommHookState(wire_dtype=torch.bfloat16), rr.ddp_comm_hook)
    _train([ddp, averaged, hooked, wired, wired_hooked], dev, rank)
    checked = 0
    for want, *got in zip(ref_model.parameters(), averaged.parameters(), hooked_model.parameters(),
                          wired.parameters(), wired_hook_model.parameters(), strict=True):
        for k, p in enumerate(got):
            tol = (1e-5, 1e-6) if k < 2 else (2e-2, 2e-3)  # the wire rounds each partial to bfloat16
            torch.testing.assert_close(p.detach(), want.detach(), rtol=tol[0], atol=tol[1])
            assert same_on_all_ranks(p.detach()), f"model {k}: ranks differ"
            checked += 1
    del averager, wired_averager
    return checked


def test_gradient_averager_and_ddp_hook_match_ddp():
    counts = run_gpu_ranks(_hooks_match_ddp)
    assert all(c == 16 for c in counts), counts  # 4 parameters x 4 averaged models


def _coalesced_options(rank: int, n: int, on_cuda: bool = True) -> int:
    """all_reduce_coalesced with a 16-bit wire and a predivide factor: each tensor gets the bits
    rr.all_reduce gives its dtype's packed buffer with the same options (the wire on float32 only),
    on a strided view too, identical on every rank."""
    import ringreduce as rr

    dev = device(rank) if on_cuda else torch.device("cpu")
    gen = torch.Generator().manual_seed(77 + rank)
    base = torch.randn(37, 5, generator=gen).to(dev)
    tensors = [torch.randn(1000, generator=gen).to(dev), base.t(),  # float32, a transposed view
               torch.randn(300, generator=gen).to(dev, torch.bfloat16),
               torch.randn(3 * 2**18 + 5, generator=gen).to(dev),  # float32 beyond the one-shot sizes
               torch.randn(77, generator=gen).to(dev, torch.float64)]
    runs = 0
    for op, kwargs in (("avg", dict(wire_dtype=torch.bfloat16, predivide_factor=2.0)),
                       ("sum", dict(wire_dtype=torch.float16)), ("avg", dict(predivide_factor=4.0))):
        inputs = [t.clone() for t in tensors]
        want = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            flat = torch.cat([t.reshape(-1) for t in inputs if t.dtype == dtype])
            opts = dict(kwargs) if dtype == torch.float32 else {"predivide_factor": kwargs.get("predivide_factor")}
            rr.all_reduce(flat, op=op, **opts)
            want[dtype] = flat
        work = [t.clone() for t in tensors]
        view = base.clone().t()  # the view's results land in its base's storage
        work[1] = view
        rr.all_reduce_coalesced(work, op=op, **kwargs)
        offsets = dict.fromkeys(want, 0)
        for t in work:
            k = t.numel()
            expect = want[t.dtype][offsets[t.dtype]:offsets[t.dtype] + k].view(t.shape)
            offsets[t.dtype] += k
            assert bits_equal(t, expect), f"{op} {kwargs} {t.dtype} {tuple(t.shape)}"
            assert same_on_all_ranks(t)
        runs += 1
    dist.barrier()
    return runs


def test_coalesced_with_all_reduce_options():
    assert all(c == 3 for c in run_gpu_ranks(_coalesced_options))
