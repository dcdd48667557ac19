"""ringreduce.nn: autograd-aware all_gather and reduce_scatter.

- A contrastive (InfoNCE) loss over gathered embeddings, gradients averaged afterwards, equals one
  process computing the loss on the concatenated batch (float64, 2 and 4 ranks).
- Backward of both collectives against hand-computed vector-Jacobian products with integer-valued
  float64 data (exact equality), double backward, and a finite-difference check of the sum over
  ranks of the per-rank losses, with every rank perturbing in lockstep.
- Uneven shapes, bad ops and bad shapes raise on every rank; tensors without grad work.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import CPU_PLACES, place_cases, run_ranks
from ranks import expect_raises as _expect
from refdata import gather_inputs

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

WORLD_SIZES = [2, 4]
BATCH = 8  # global pairs per step, divisible by 2 and 4
TEMPERATURE = 0.5




def ints(shape: tuple[int, ...], rank: int, salt: int = 0) -> torch.Tensor:
    """Integer-valued float64 data that depends on position and rank."""
    i = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float64)
    return ((i * 7 + rank * 5 + salt) % 11 - 5).reshape(shape)


# ------------------------------------------------------------------------------ contrastive loss


def make_encoder() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double()


def views(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(BATCH, 5, generator=g, dtype=torch.float64)
    return x, x + 0.1 * torch.randn(BATCH, 5, generator=g, dtype=torch.float64)


def info_nce(z_a: torch.Tensor, z_b: torch.Tensor, rows: slice | None = None) -> torch.Tensor:
    """Symmetric InfoNCE of all pairs; with `rows`, the one-directional loss of those queries only."""
    z_a, z_b = F.normalize(z_a, dim=1), F.normalize(z_b, dim=1)
    labels = torch.arange(z_a.shape[0])
    if rows is not None:
        return F.cross_entropy(z_a[rows] @ z_b.T / TEMPERATURE, labels[rows])
    logits = z_a @ z_b.T / TEMPERATURE
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _contrastive(rank: int, ws: int, averaging: str, local_queries: bool) -> None:
    model = make_encoder()
    ref = make_encoder()
    averager = rr.GradientAverager(model) if averaging == "averager" else None
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    per = BATCH // ws
    mine = slice(rank * per, (rank + 1) * per)
    for step in range(3):
        x_a, x_b = views(step)
        # The reference: one process, the whole batch, gathered from the ranks' slices.
        full_a = gather_inputs(x_a[mine].contiguous()).reshape(BATCH, 5)
        full_b = gather_inputs(x_b[mine].contiguous()).reshape(BATCH, 5)
        assert torch.equal(full_a, x_a)
        ref_opt.zero_grad()
        info_nce(ref(full_a), ref(full_b), None if not local_queries else slice(None)).backward()
        # Distributed: embed the local slice, gather with autograd, same loss on every rank.
        opt.zero_grad(set_to_none=True)
        z_a, z_b = model(x_a[mine]), model(x_b[mine])
        all_a, all_b = rr.nn.all_gather(z_a), rr.nn.all_gather(z_b)
        assert all_a.shape == (BATCH, 4) and all_a.requires_grad
        if local_queries:  # rank r: its own queries against every key; the mean over ranks is the loss
            info_nce(all_a, all_b, mine).backward()
        else:
            info_nce(all_a, all_b).backward()
        if averager is None:
            local = [p.grad.clone() for p in model.parameters()]
            summed = [gather_inputs(g).sum(0) / ws for g in local]
            for p in model.parameters():
                rr.all_reduce_avg(p.grad)
            for p, s, g in zip(model.parameters(), summed, local, strict=True):
                assert torch.allclose(p.grad, s, rtol=1e-12, atol=1e-14)
                assert not torch.allclose(g, p.grad), "local gradients already equal the average"
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, n=name, s=step: f"step {s} {n}: {m}")
        opt.step()
        ref_opt.step()
    if averager is not None:
        averager.remove()


# Over tcp (ranks.py's Note [Places]) each averaging once, on 4 and on 2 ranks.
@place_cases("averaging,ws", [(a, ws) for a in ("all_reduce_avg", "averager") for ws in WORLD_SIZES],
                 tcp=[("all_reduce_avg", 4), ("averager", 2)])
def test_contrastive_loss_matches_single_process(ws: int, averaging: str) -> None:
    run_ranks(ws, _contrastive, averaging, False)


def test_contrastive_loss_of_local_queries_matches_mean_over_ranks() -> None:
    run_ranks(2, _contrastive, "averager", True)


# ----------------------------------------------------------------------- exact backward (VJPs)

_SOLO: list = []


def solo_group():
    """A process group of rank 0 alone (created once per process: new_group is collective)."""
    if not _SOLO:
        _SOLO.append(dist.new_group([0]))
    return _SOLO[0]



def _exact_vjps(rank: int, ws: int) -> None:
    # all_gather: rank r's input gets the sum over ranks of the gradient of block r
    for shape in [(3, 2), (1,), (2, 3, 2)]:
        x = ints(shape, rank).requires_grad_(True)
        out = rr.nn.all_gather(x)
        assert torch.equal(out.detach(), gather_inputs(x.detach()).reshape(ws * shape[0], *shape[1:]))
        g = ints(tuple(out.shape), rank, salt=3)
        out.backward(g)
        blocks = gather_inputs(g).reshape(ws, ws, *shape)  # [sender s, block r, ...]
        assert torch.equal(x.grad, blocks[:, rank].sum(0)), f"all_gather {shape}: {x.grad}"
    # 0-d input: gathered to (n,)
    s = torch.tensor(float(rank + 1), dtype=torch.float64, requires_grad=True)
    out = rr.nn.all_gather(s)
    assert torch.equal(out.detach(), torch.arange(1, ws + 1, dtype=torch.float64))
    (out * torch.arange(ws, dtype=torch.float64) * (rank + 1)).sum().backward()
    assert s.grad.shape == () and s.grad.item() == rank * ws * (ws + 1) / 2
    # an expanded (stride-0) incoming gradient: out.sum()
    x = ints((5, 3), rank).requires_grad_(True)
    rr.nn.all_gather(x).sum().backward()
    assert torch.equal(x.grad, torch.full((5, 3), float(ws)))
    # reduce_scatter: rank r gets block r of the reduction; backward all-gathers the gradients
    for op, scale in (("sum", 1.0), ("avg", 1.0 / ws), (rr.ReduceOp.AVG, 1.0 / ws), (dist.ReduceOp.SUM, 1.0)):
        x = ints((ws * 3, 2), rank, salt=1).requires_grad_(True)
        out = rr.nn.reduce_scatter(x, op=op)
        everyone = gather_inputs(x.detach()).sum(0).reshape(ws, 3, 2)
        assert torch.equal(out.detach(), everyone[rank] * scale), f"reduce_scatter {op}"
        g = ints((3, 2), rank, salt=5)
        out.backward(g)
        assert torch.equal(x.grad, gather_inputs(g).reshape(ws * 3, 2) * scale), f"reduce_scatter {op} backward"
    # double backward: loss = sum(all_gather(x)**2); g = d loss/dx = 2 n x; d sum(g)/dx = 2 n
    x = ints((2, 2), rank).requires_grad_(True)
    (gx,) = torch.autograd.grad(rr.nn.all_gather(x).pow(2).sum(), x, create_graph=True)
    assert torch.equal(gx.detach(), 2 * ws * x.detach())
    gx.sum().backward()
    assert torch.equal(x.grad, torch.full((2, 2), 2.0 * ws))
    # without autograd: plain results, nothing recorded
    y = ints((2, 3), rank)
    out = rr.nn.all_gather(y)
    assert not out.requires_grad and torch.equal(out, gather_inputs(y).reshape(2 * ws, 3))
    with torch.no_grad():
        out = rr.nn.reduce_scatter(ints((ws, 1), rank).requires_grad_(True), op="sum")
    assert not out.requires_grad
    n = rr.nn.all_gather(torch.arange(3) + rank)  # integer tensors too
    assert n.dtype == torch.int64 and torch.equal(n, torch.cat([torch.arange(3) + r for r in range(ws)]))
    # a group of one rank: a copy there, None on the ranks outside it
    x = ints((2, 2), rank).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = rr.nn.all_gather(x, group=solo_group())
        block = rr.nn.reduce_scatter(x, group=solo_group())
    if rank == 0:
        (alone.sum() + block.sum()).backward()
        assert torch.equal(alone.detach(), x.detach()) and torch.equal(x.grad, torch.full((2, 2), 2.0))
    else:
        assert alone is None and block is None


@place_cases("ws", WORLD_SIZES, tcp=[4])
def test_backward_is_the_other_half_of_the_ring(ws: int) -> None:
    run_ranks(ws, _exact_vjps)


def _finite_differences(rank: int, ws: int) -> None:
    """Central differences of F = sum over ranks of L_r, one global input element at a time.

    Every rank runs the same loop; only the owner of the perturbed element perturbs its input, so
    each collective in the loop sees a consistent global input.
    """
    weights = ints((2 * ws, 1), rank, salt=2) / 4

    def loss_ag(x: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(rr.nn.all_gather(x) / 4) * weights).sum()

    def loss_rs(x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(rr.nn.reduce_scatter(x, op="avg")) * weights[:2]).sum() + x.pow(2).sum() / 16

    for loss, shape in ((loss_ag, (2, 1)), (loss_rs, (2 * ws, 1))):
        x = ints(shape, rank) / 2
        x.requires_grad_(True)
        loss(x).backward()
        analytic = gather_inputs(x.grad)
        numeric = torch.zeros((ws, *shape), dtype=torch.float64)
        eps = 1e-6
        with torch.no_grad():
            for owner in range(ws):
                for i in range(x.numel()):
                    values = []
                    for sign in (1.0, -1.0):
                        xp = x.detach().clone()
                        if rank == owner:
                            xp.view(-1)[i] += sign * eps
                        total = loss(xp).reshape(1)
                        dist.all_reduce(total)
                        values.append(total.item())
                    numeric[owner].view(-1)[i] = (values[0] - values[1]) / (2 * eps)
        torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-7)


@place_cases("ws", WORLD_SIZES, tcp=[2])
def test_gradients_match_finite_differences(ws: int) -> None:
    run_ranks(ws, _finite_differences)


# ---------------------------------------------------------------------------------------- errors


def _errors(rank: int, ws: int) -> dict:
    out = {}
    # uneven first dimensions: every rank raises, naming the shapes
    x = torch.ones(2 + (rank == 1), 3, requires_grad=True)
    out["uneven"] = _expect(lambda: rr.nn.all_gather(x), RuntimeError, "ringreduce.nn.all_gather", "same shape",
                            "disagree", "shape=[2, 3]", "shape=[3, 3]")
    # a different trailing shape with the same numel
    y = torch.ones(2, 6) if rank == 0 else torch.ones(3, 4)
    out["trailing"] = _expect(lambda: rr.nn.all_gather(y), RuntimeError, "disagree", "shape")
    # an op without a gradient: refused on every rank
    z = torch.ones(ws * 2)
    out["max_everywhere"] = _expect(lambda: rr.nn.reduce_scatter(z, op="max"), ValueError, "SUM and AVG")
    out["bad_op"] = _expect(lambda: rr.nn.reduce_scatter(z, op="band"), ValueError, "unsupported reduce op")
    # one rank refuses (an op, a shape): it raises ValueError, the others RuntimeError
    if rank == 1:
        out["max_one"] = _expect(lambda: rr.nn.reduce_scatter(z, op="product"), ValueError, "PRODUCT")
        out["split_one"] = _expect(lambda: rr.nn.reduce_scatter(torch.ones(ws * 2 + 1), op="sum"), ValueError,
                                   "cannot be split")
        out["not_tensor"] = _expect(lambda: rr.nn.reduce_scatter([1.0, 2.0]), TypeError, "torch.Tensor")
    else:
        for key in ("max_one", "split_one", "not_tensor"):
            out[key] = _expect(lambda: rr.nn.reduce_scatter(z, op="sum"), RuntimeError, "rank 1", "refused")
    out["zero_d"] = _expect(lambda: rr.nn.reduce_scatter(torch.tensor(1.0)), ValueError, "cannot be split")
    # the group is still usable, with autograd
    w = torch.full((2,), float(rank), requires_grad=True)
    gathered = rr.nn.all_gather(w)
    gathered.sum().backward()
    expected = torch.arange(ws, dtype=torch.float32).repeat_interleave(2)
    out["still_works"] = "ok" if torch.equal(gathered.detach(), expected) and torch.equal(
        w.grad, torch.full((2,), float(ws))) else f"got {gathered}, {w.grad}"
    return out


@place_cases("ws", WORLD_SIZES, tcp=[4])
def test_errors_raise_on_every_rank(ws: int) -> None:
    for r in run_ranks(ws, _errors):
        bad = {k: v for k, v in r.items() if v != "ok"}
        assert not bad, bad
