"""GradientAverager: parity with single-process training and stock DDP, unused/tied parameters,
no_sync, removal, activation checkpointing, launch order, errors and gradient_as_bucket_view; DDP +
ddp_comm_hook and all_reduce_coalesced with all_reduce's options beside them.

Every case runs on world sizes 2 and 3 of the persistent pools. References are computed on each rank
without communication (same seeds; the global batch is known to every rank). The bodies that put
their tensors on ``device(rank)`` also run at the place "cuda" (Note [Places] in ranks.py): the
cases listed with ``cuda=`` and the tests marked ``only_place(*ALL_PLACES)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from gpu.gpu_ranks import world as gpu_world
from ranks import ALL_PLACES, CPU_PLACES, SHM_ONLY, device, only_place, place_cases, run_ranks
from refdata import bits_equal, same_on_all_ranks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

RTOL, ATOL = 1.3e-6, 5e-5
GLOBAL_BATCH = 12  # divisible by 2 and 3
STEPS = 5
WORLD_SIZES = [2, 3]
# Over tcp (ranks.py's Note [Places]) the hooks' calls are the same all_reduces; one world
# size (3: distinct neighbours, uneven chunks) per test, both bucket caps in the MLP parity.
TCP_WORLD_SIZES = [3]
MLP_CASES = [(cap_mb, momentum, ws) for cap_mb in (25.0, 0.001) for momentum in (0.0, 0.9) for ws in WORLD_SIZES]


# ------------------------------------------------------------------------------------ helpers


def make_mlp(seed: int = 0, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 10), nn.Tanh(), nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 4)).to(device)


def global_batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 2, generator=g)
    y = torch.randn(GLOBAL_BATCH, 4, generator=g)
    return x.to(device), y.to(device)


def local_batch(step: int, rank: int, ws: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, device)
    per = GLOBAL_BATCH // ws
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def assert_params_close(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.detach(), pb.detach(), rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{what} {n}: {m}")


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def assert_identical_across_ranks(t: torch.Tensor, what: str) -> None:
    for r, other in enumerate(gather(t)):
        assert torch.equal(other, t), f"{what} differs between this rank and rank {r}"


def sgd(model: nn.Module, momentum: float) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)


# --------------------------------------------------------------------------------- MLP parity


def _ddp(model: nn.Module, dev: torch.device, **kwargs) -> DDP:
    return DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None, **kwargs)


def _mlp_parity(rank: int, ws: int, momentum: float, cap_mb: float, view: bool, accum_dtype) -> list[int]:
    dev = device(rank)
    ref = make_mlp(device=dev)
    ours = make_mlp(device=dev)
    stock = _ddp(make_mlp(device=dev), dev, bucket_cap_mb=cap_mb)
    avg = rr.GradientAverager(ours, bucket_cap_mb=cap_mb, gradient_as_bucket_view=view, accum_dtype=accum_dtype)
    opts = [sgd(ref, momentum), sgd(ours, momentum), sgd(stock, momentum)]
    for step in range(STEPS):
        x, y = global_batch(step, dev)
        lx, ly = local_batch(step, rank, ws, dev)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ours(lx), ly).backward()
        F.mse_loss(stock(lx), ly).backward()
        for p in ours.parameters():
            assert_identical_across_ranks(p.grad, f"step {step} grad")
        for opt in opts:
            opt.step()
        assert_params_close(ours, ref, f"step {step} GradientAverager vs single process:")
        assert_params_close(ours, stock.module, f"step {step} GradientAverager vs DDP:")
    avg.remove()
    return avg.bucket_sizes


@place_cases("cap_mb,momentum,ws", MLP_CASES, tcp=[(25.0, 0.0, 2), (0.001, 0.9, 3)], cuda=[(25.0, 0.0, 2), (0.001, 0.9, 2)])
def test_mlp_matches_single_process_and_ddp(ws: int, momentum: float, cap_mb: float) -> None:
    view = cap_mb < 1  # both layouts get covered without doubling the matrix
    sizes = run_ranks(ws, _mlp_parity, momentum, cap_mb, view, None)
    assert all(s == sizes[0] for s in sizes)
    assert sum(sizes[0]) == sum(p.numel() for p in make_mlp().parameters())
    if cap_mb < 1:
        assert len(sizes[0]) >= 2  # tiny buckets really split the model
    else:
        assert len(sizes[0]) == 1


def test_accum_dtype_on_float32_model_is_accepted() -> None:
    run_ranks(2, _mlp_parity, 0.0, 0.001, False, torch.float32)


# ------------------------------------------------------------------------ Linear(1, 5) parity


def _linear_parity(rank: int, ws: int, cap_mb: float) -> None:
    dev = device(rank)
    torch.manual_seed(0)
    lin = nn.Linear(1, 5).to(dev)
    avg = rr.GradientAverager(lin, bucket_cap_mb=cap_mb)
    expected = sum(range(ws)) / ws
    for _ in range(20):
        lin.zero_grad(set_to_none=True)
        lin(torch.tensor([[float(rank)]], device=dev)).sum().backward()
        assert torch.equal(lin.weight.grad, torch.full((5, 1), expected, device=dev)), lin.weight.grad
        assert torch.equal(lin.bias.grad, torch.ones(5, device=dev))
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES, cuda=[2])
def test_linear_grad_is_mean_of_ranks(ws: int) -> None:
    run_ranks(ws, _linear_parity, 25.0)
    run_ranks(ws, _linear_parity, 1e-6)


# ------------------------------------------------------------------------------------ no_sync


def _no_sync(rank: int, ws: int, view: bool) -> None:
    ref, ours = make_mlp(), make_mlp()
    avg = rr.GradientAverager(ours, bucket_cap_mb=0.001, gradient_as_bucket_view=view)
    ref_opt, opt = sgd(ref, 0.9), sgd(ours, 0.9)
    for it in range(2):
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        micro = [3 * it, 3 * it + 1, 3 * it + 2]
        for step in micro:
            x, y = global_batch(step)
            F.mse_loss(ref(x), y).backward()
        with avg.no_sync():
            for k, step in enumerate(micro[:-1]):
                lx, ly = local_batch(step, rank, ws)
                F.mse_loss(ours(lx), ly).backward()
                with torch.no_grad():  # adds nothing
                    ours(lx)
                if k == 0:
                    # Local only: equals this rank's own gradient, which differs between ranks.
                    local = make_mlp()
                    local.load_state_dict(ours.state_dict())
                    F.mse_loss(local(lx), ly).backward()
                    for p, q in zip(ours.parameters(), local.parameters(), strict=True):
                        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
                    assert not all(torch.equal(g, ours[0].weight.grad) for g in gather(ours[0].weight.grad))
        lx, ly = local_batch(micro[-1], rank, ws)
        F.mse_loss(ours(lx), ly).backward()
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            # sum over micro-steps of the full-batch mean == average over ranks of local sums
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
            assert_identical_across_ranks(p.grad, "synced grad")
        ref_opt.step()
        opt.step()
        assert_params_close(ours, ref, f"after accumulation round {it}:")
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES)
def test_no_sync_accumulates_then_averages(ws: int) -> None:
    run_ranks(ws, _no_sync, False)
    run_ranks(ws, _no_sync, True)


# ------------------------------------------------------------------- unused and tied parameters


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(3, 4)  # used by rank 0 only
        self.never = nn.Linear(3, 4)  # used by no rank
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.a(x)
        if use_b:
            h = h + self.b(x)
        return self.head(torch.tanh(h))


def _branchy_input(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(100 * step + rank))


def _unused(rank: int, ws: int, cap_mb: float, view: bool) -> None:
    model = Branchy()
    avg = rr.GradientAverager(model, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        # Expected: each rank's local gradients, computed here for every rank, averaged.
        expected: dict[str, torch.Tensor] = {}
        for r in range(ws):
            local = Branchy()
            local.load_state_dict(model.state_dict())
            local(_branchy_input(r, step), use_b=(r == 0)).sum().backward()
            for name, p in local.named_parameters():
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                expected[name] = expected.get(name, 0) + g / ws
        opt.zero_grad(set_to_none=True)
        model(_branchy_input(rank, step), use_b=(rank == 0)).sum().backward()
        for name, p in model.named_parameters():
            if name.startswith("never."):
                assert p.grad is None, f"{name} is unused on every rank but got a gradient"
                continue
            assert p.grad is not None, f"{name} is used on some rank but has no gradient on rank {rank}"
            torch.testing.assert_close(p.grad, expected[name], rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
            assert_identical_across_ranks(p.grad, name)
        opt.step()
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES)
def test_unused_and_locally_unused_parameters(ws: int) -> None:
    run_ranks(ws, _unused, 25.0, False)
    run_ranks(ws, _unused, 1e-6, False)  # one bucket per parameter: unused ones mid-order
    run_ranks(ws, _unused, 1e-6, True)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.inp = nn.Linear(2, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.out = nn.Linear(6, 6)
        self.out.weight = self.mid.weight  # tied
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.out(torch.tanh(self.mid(self.inp(x))))))


def _tied(rank: int, ws: int, cap_mb: float) -> None:
    dev = device(rank)
    ref, ours = Tied().to(dev), Tied().to(dev)
    # Passing a parameter list with the tied weight twice must still average it once.
    params = [p for m in ours.modules() if isinstance(m, nn.Linear) for p in m.parameters()]
    assert len(params) == len(list(ours.parameters())) + 1
    avg = rr.GradientAverager(params, bucket_cap_mb=cap_mb)
    assert sum(len(b) for b in avg.bucket_parameters) == len(list(ours.parameters()))
    ref_opt, opt = sgd(ref, 0.9), sgd(ours, 0.9)
    for step in range(STEPS):
        x, y = global_batch(step, dev)
        lx, ly = local_batch(step, rank, ws, dev)
        ref_opt.zero_grad()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ours(lx), ly).backward()
        ref_opt.step()
        opt.step()
        assert_params_close(ours, ref, f"step {step} tied:")
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES, cuda=[2])
def test_tied_parameters_averaged_once(ws: int) -> None:
    run_ranks(ws, _tied, 25.0)
    run_ranks(ws, _tied, 1e-6)


# ------------------------------------------------------------------------------------- remove


def _removed(rank: int, ws: int) -> None:
    model = make_mlp()
    lx, ly = local_batch(0, rank, ws)
    with rr.GradientAverager(model, bucket_cap_mb=0.001):
        F.mse_loss(model(lx), ly).backward()
        assert_identical_across_ranks(model[0].weight.grad, "synced grad")
    avg = rr.GradientAverager(model)
    avg.remove()
    avg.remove()  # idempotent
    for step in range(2):
        lx, ly = local_batch(step, rank, ws)
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(lx), ly).backward()
        local = make_mlp()
        local.load_state_dict(model.state_dict())
        F.mse_loss(local(lx), ly).backward()
        for p, q in zip(model.parameters(), local.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), "after remove() gradients must stay local"
        grads = gather(model[0].weight.grad)
        assert not torch.equal(grads[0], grads[1]), "local gradients should differ between ranks"


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES)
def test_removed_hooks_leave_training_local(ws: int) -> None:
    run_ranks(ws, _removed)


# ------------------------------------------------------------------------------ checkpointing


class CheckpointedMLP(nn.Module):
    def __init__(self, where: str, reentrant: bool) -> None:
        super().__init__()
        self.net = make_mlp()
        self.where = where
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        l1, a1, l2, a2, l3 = self.net
        h = a1(l1(x))
        if self.where == "middle":
            h = checkpoint(lambda t: a2(l2(t)), h, use_reentrant=self.reentrant)
            return l3(h)
        # "end": the whole tail, including the output layer, is recomputed in the inner backward
        return checkpoint(lambda t: l3(a2(l2(t))), h, use_reentrant=self.reentrant)


def _checkpointed(rank: int, ws: int, where: str, reentrant: bool, cap_mb: float) -> None:
    ref = make_mlp()
    ours = CheckpointedMLP(where, reentrant)
    avg = rr.GradientAverager(ours, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb)
    ref_opt, opt = sgd(ref, 0.9), sgd(ours, 0.9)
    for step in range(3):
        x, y = global_batch(step)
        lx, ly = local_batch(step, rank, ws)
        ref_opt.zero_grad()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ours(lx), ly).backward()
        assert not avg._round, "the round must be finished when backward returns"
        for p in ours.parameters():
            assert_identical_across_ranks(p.grad, "grad")
        ref_opt.step()
        opt.step()
        assert_params_close(ours.net, ref, f"step {step} checkpoint {where} reentrant={reentrant}:")
    avg.remove()


@place_cases("reentrant,ws", [(r, ws) for r in (True, False) for ws in WORLD_SIZES], tcp=[(True, 3), (False, 2)])
def test_activation_checkpointing(ws: int, reentrant: bool) -> None:
    for where in ("middle", "end"):
        run_ranks(ws, _checkpointed, where, reentrant, 1e-6)
    run_ranks(ws, _checkpointed, "end", reentrant, 25.0)


# ----------------------------------------------------------------------------- launch ordering


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.left = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
        self.right = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, left_first: bool) -> torch.Tensor:
        if left_first:
            a = self.left(x)
            b = self.right(x)
        else:
            b = self.right(x)
            a = self.left(x)
        return a + b


def _order(rank: int, ws: int) -> list[int]:
    model = TwoBranches()
    fired: list[int] = []
    index = {id(p): k for k, p in enumerate(model.parameters())}
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.append(index[id(q)]))
    avg = rr.GradientAverager(model, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    assert len(avg.bucket_sizes) == len(list(model.parameters()))
    expected: dict[str, torch.Tensor] = {}
    for r in range(ws):
        local = TwoBranches()
        local(_branchy_input(r, 0)[:, :2].repeat(1, 2), left_first=(r % 2 == 0)).pow(2).sum().backward()
        for name, p in local.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad / ws
    model(_branchy_input(rank, 0)[:, :2].repeat(1, 2), left_first=(rank % 2 == 0)).pow(2).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=RTOL, atol=1e-6)
    avg.remove()
    return fired


def test_buckets_launch_in_index_order_whatever_the_hook_order() -> None:
    fired = run_ranks(2, _order)
    # The premise: hooks really fired in different orders on the two ranks.
    assert fired[0] != fired[1] and sorted(fired[0]) == sorted(fired[1])


# ------------------------------------------------------------------------------------- errors


class _FailOnce(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        if _FailOnce.armed:
            raise ValueError("injected failure in backward")
        return g


def _second_backward(rank: int, ws: int) -> None:
    model = make_mlp()
    l1, a1, l2, a2, l3 = model
    avg = rr.GradientAverager(model, bucket_cap_mb=1e-6, first_bucket_mb=1e-6)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return l3(a2(l2(_FailOnce.apply(a1(l1(x))))))

    lx, ly = local_batch(0, rank, ws)
    _FailOnce.armed = True
    try:
        F.mse_loss(forward(lx), ly).backward()
        raise AssertionError("the injected failure did not raise")
    except ValueError:
        pass
    finally:
        _FailOnce.armed = False
    # l3's and l2's buckets went out; the round was never finished. A new backward must refuse.
    try:
        F.mse_loss(forward(lx), ly).backward()
        raise AssertionError("a second backward before synchronize() did not raise")
    except RuntimeError as exc:
        assert "second backward" in str(exc) and "synchronize()" in str(exc), str(exc)
    avg.synchronize()  # finishes the broken round on every rank
    avg.synchronize()  # and is a no-op now
    # Training works again and is correct.
    model.zero_grad(set_to_none=True)
    F.mse_loss(forward(lx), ly).backward()
    ref = make_mlp()
    x, y = global_batch(0)
    F.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES)
def test_second_backward_before_sync_is_an_error(ws: int) -> None:
    run_ranks(ws, _second_backward)


def _bad_arguments(rank: int, ws: int) -> None:
    model = make_mlp()
    for kwargs, exc in (
        ({"bucket_cap_mb": 0}, ValueError),
        ({"first_bucket_mb": -1}, ValueError),
        ({"accum_dtype": torch.float64}, TypeError),
    ):
        with pytest.raises(exc):
            rr.GradientAverager(model, **kwargs)
    with pytest.raises(TypeError, match="nn.Module or an iterable"):
        rr.GradientAverager(42)
    with pytest.raises(TypeError, match="parameter groups"):
        rr.GradientAverager([{"params": list(model.parameters())}])
    with pytest.raises(ValueError, match="leaf"):
        rr.GradientAverager([model[0].weight * 2])
    with pytest.raises(TypeError, match="state must be"):
        rr.ddp_comm_hook("not a group", None)


@SHM_ONLY  # refused in Python before any call
def test_bad_arguments() -> None:
    run_ranks(2, _bad_arguments)


@SHM_ONLY  # no ranks
def test_needs_initialized_process_group() -> None:
    if dist.is_initialized():
        pytest.skip("another test initialized a process group in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        rr.GradientAverager(make_mlp())


# ----------------------------------------------------------------------- gradient_as_bucket_view


def _bucket_view(rank: int, ws: int) -> None:
    ref, ours = make_mlp(), make_mlp()
    avg = rr.GradientAverager(ours, bucket_cap_mb=0.001, gradient_as_bucket_view=True)
    buffers = {b.buffer.untyped_storage().data_ptr() for b in avg._buckets}
    ref_opt, opt = sgd(ref, 0.9), sgd(ours, 0.9)
    for step in range(4):
        set_to_none = step % 2 == 0
        ref_opt.zero_grad(set_to_none=set_to_none)
        opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert all(p.grad is None for p in ours.parameters())
        x, y = global_batch(step)
        lx, ly = local_batch(step, rank, ws)
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(ours(lx), ly).backward()
        for i, (p, q) in enumerate(zip(ours.parameters(), ref.parameters(), strict=True)):
            assert p.grad.untyped_storage().data_ptr() in buffers, "grad is not a view of a bucket buffer"
            assert p.grad.data_ptr() == avg._slots[i].data_ptr()
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        ref_opt.step()
        opt.step()
        assert_params_close(ours, ref, f"step {step} bucket view:")
    # A channels_last parameter keeps its layout in the view.
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    avg2 = rr.GradientAverager(conv, gradient_as_bucket_view=True)
    conv(torch.randn(2, 3, 5, 5).to(memory_format=torch.channels_last)).sum().backward()
    assert conv.weight.grad.stride() == conv.weight.stride()
    assert conv.weight.grad.data_ptr() == avg2._slots[0].data_ptr()
    avg2.remove()
    avg.remove()


@place_cases("ws", WORLD_SIZES, tcp=TCP_WORLD_SIZES)
def test_gradient_as_bucket_view(ws: int) -> None:
    run_ranks(ws, _bucket_view)


@SHM_ONLY  # no ranks
def test_bucket_assignment_reverse_order_and_caps() -> None:
    from ringreduce.hooks.buckets import _assign_buckets

    params = [torch.zeros(256, requires_grad=True) for _ in range(6)]  # 1 KiB each
    params.insert(3, torch.zeros(10, dtype=torch.float64, requires_grad=True))
    mb = 1024 * 1024
    buckets = _assign_buckets(params, cap_bytes=2048, first_cap_bytes=1024)
    assert [m for _, _, m in buckets] == [[6], [5, 4], [3], [2, 1], [0]]
    assert [d for d, _, _ in buckets] == [torch.float32, torch.float32, torch.float64, torch.float32, torch.float32]
    assert [m for _, _, m in _assign_buckets(params, 25 * mb, mb)] == [[6, 5, 4, 2, 1, 0], [3]]


# -------------------------------- every place, CUDA included: the averager and the DDP hook against DDP
# (tests/gpu/test_gpu_hooks.py until issue 46: one test per place instead of a GPU twin)


def _model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank and for every copy
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)


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


def _hooks_match_ddp(rank: int, n: int) -> int:
    """GradientAverager and DDP + rr.ddp_comm_hook give DDP's parameters after 3 SGD steps (within
    float32 rounding: DDP sums then divides, ringreduce divides the complete sum once), the same
    bits on every rank; with a bfloat16 wire (GradientAverager(wire_dtype=...) and
    rr.CommHookState(wire_dtype=...)) within the wire's rounding of DDP's, again identical on every
    rank."""
    dev = device(rank)
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


@only_place(*ALL_PLACES)
def test_gradient_averager_and_ddp_hook_match_ddp(place):
    counts = run_ranks(gpu_world() if place == "cuda" else 2, _hooks_match_ddp, timeout=240)
    assert all(c == 16 for c in counts), counts  # 4 parameters x 4 averaged models


def _coalesced_options(rank: int, n: int) -> int:
    """all_reduce_coalesced with a 16-bit wire and a predivide factor: each tensor gets the bits
    rr.all_reduce gives its dtype's packed buffer with the same options (the wire on float32 only),
    on a strided view too, identical on every rank."""
    dev = device(rank)
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


@only_place(*ALL_PLACES)
def test_coalesced_with_all_reduce_options(place):
    assert all(c == 3 for c in run_ranks(gpu_world() if place == "cuda" else 2, _coalesced_options, timeout=240))
