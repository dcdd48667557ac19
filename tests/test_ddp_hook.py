"""ringreduce.ddp_comm_hook inside torch's DistributedDataParallel: parity with stock DDP, at the CPU
places and, for the cases listed with ``cuda=``, on CUDA (Note [Places] in ranks.py)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from ranks import CPU_PLACES, device, place_cases, run_ranks
from test_hooks import (
    STEPS,
    WORLD_SIZES,
    assert_identical_across_ranks,
    assert_params_close,
    global_batch,
    local_batch,
    make_mlp,
    sgd,
)
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)


def _ddp(model: nn.Module, dev: torch.device, **kwargs) -> DDP:
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **kwargs)


def _ddp_parity(rank: int, ws: int, momentum: float, cap_mb: float, state_kind: str) -> int:
    dev = device(rank)
    group = dist.new_group(list(range(ws))) if state_kind != "none" else None
    state = {
        "none": None,
        "group": group,
        "object": types.SimpleNamespace(process_group=group),
    }[state_kind]
    ref = make_mlp(device=dev)
    stock = _ddp(make_mlp(device=dev), dev, bucket_cap_mb=cap_mb)
    ours = _ddp(make_mlp(device=dev), dev, bucket_cap_mb=cap_mb, process_group=group)
    calls = []

    def hook(st, bucket):  # noqa: ANN001, ANN202 - counts calls, then delegates
        calls.append(bucket.index())
        return rr.ddp_comm_hook(st, bucket)

    ours.register_comm_hook(state, hook)
    opts = [sgd(ref, momentum), sgd(stock, momentum), sgd(ours, momentum)]
    for step in range(STEPS):
        x, y = global_batch(step, dev)
        lx, ly = local_batch(step, rank, ws, dev)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(stock(lx), ly).backward()
        F.mse_loss(ours(lx), ly).backward()
        for p in ours.parameters():
            assert_identical_across_ranks(p.grad.cpu(), f"step {step} grad")
        for opt in opts:
            opt.step()
        assert_params_close(ours.module, stock.module, f"step {step} DDP+ringreduce hook vs stock DDP:")
        assert_params_close(ours.module, ref, f"step {step} DDP+ringreduce hook vs single process:")
    return len(calls)


# Over tcp (ranks.py's Note [Places]) one bucket on 2 ranks and many on 3 (the hook state
# kinds are Python; every combination runs over shm).
@place_cases("cap_mb,momentum,ws", [(c, m, ws) for c in (25.0, 0.001) for m in (0.0, 0.9) for ws in WORLD_SIZES],
             tcp=[(25.0, 0.9, 2), (0.001, 0.0, 3)], cuda=[(25.0, 0.9, 2), (0.001, 0.9, 2)])
def test_ddp_comm_hook_matches_stock_ddp(ws: int, momentum: float, cap_mb: float) -> None:
    state_kind = {(0.0, 25.0): "none", (0.9, 25.0): "group", (0.0, 0.001): "object", (0.9, 0.001): "none"}
    calls = run_ranks(ws, _ddp_parity, momentum, cap_mb, state_kind[(momentum, cap_mb)])
    assert len(set(calls)) == 1
    # one hook call per bucket per step: several buckets per step once DDP rebuilt them (tiny cap)
    assert calls[0] > STEPS if cap_mb < 1 else calls[0] == STEPS


def _linear_parity(rank: int, ws: int) -> None:
    dev = device(rank)
    torch.manual_seed(0)
    model = _ddp(nn.Linear(1, 5).to(dev), dev, bucket_cap_mb=1e-6)
    model.register_comm_hook(None, rr.ddp_comm_hook)
    expected = sum(range(ws)) / ws
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        model(torch.tensor([[float(rank)]], device=dev)).sum().backward()
        assert torch.equal(model.module.weight.grad, torch.full((5, 1), expected, device=dev)), model.module.weight.grad
        assert torch.equal(model.module.bias.grad, torch.ones(5, device=dev))


@place_cases("ws", WORLD_SIZES, tcp=[3], cuda=[2])
def test_ddp_comm_hook_linear_grad_is_mean_of_ranks(ws: int) -> None:
    run_ranks(ws, _linear_parity)


def _future_is_a_tensor(rank: int, ws: int) -> None:
    buf = torch.arange(6, dtype=torch.float32) * (rank + 1)
    bucket = types.SimpleNamespace(buffer=lambda: buf)
    fut = rr.ddp_comm_hook(None, bucket)
    value = fut.wait()
    assert isinstance(value, torch.Tensor) and value is buf
    scale = sum(r + 1 for r in range(ws)) / ws
    assert torch.equal(buf, torch.arange(6, dtype=torch.float32) * scale)


def test_ddp_comm_hook_future_holds_the_bucket_tensor() -> None:
    run_ranks(3, _future_is_a_tensor)

