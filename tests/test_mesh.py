"""DeviceMesh groups and DTensor gradients on 4 CPU ranks.

A (2, 2) mesh ("dp", "tp"): ranks {0, 2} and {1, 3} are data-parallel peers, {0, 1} and {2, 3}
tensor-parallel peers. Models hold tp-sharded parameters (each tp rank its own slice: DTensors with
Shard placements and plain tensors) and are averaged across "dp" only. Data are small integers, so
averages of 2 or 4 ranks are exact in float32 and everything is compared with exact equality against
a float64 reference built from an all_gather of the local values over the dp group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ranks import CPU_PLACES, place_cases, run_ranks
from refdata import gather_inputs

import ringreduce as rr

PLACES = CPU_PLACES  # conftest.py: every test at each place (Note [Places] in ranks.py)

WS = 4
_MESHES: dict[tuple, object] = {}


def mesh_of(shape: tuple[int, ...], names: tuple[str, ...]):
    """One DeviceMesh per shape and process (creating one is collective and builds process groups)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def mesh_2d():
    return mesh_of((2, 2), ("dp", "tp"))


def dp_average(t: torch.Tensor, group) -> torch.Tensor:
    """The reference: the local values of every rank of `group`, averaged in float64."""
    return gather_inputs(t.detach(), group).to(torch.float64).mean(0).to(t.dtype)


def ints(shape: tuple[int, ...], seed: int, low: int = -2, high: int = 3) -> torch.Tensor:
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed)).to(torch.float32)


# ------------------------------------------------------------------------------------ the model


class TPModel(torch.nn.Module):
    """tp-sharded parameters that differ per tp rank, and one replicated bias.

    w: a DTensor on mesh["tp"], Shard(0) (rows of an 8x3 weight); u: a DTensor on the whole 2-D
    mesh, (Replicate(), Shard(0)); v: a plain tensor holding this tp rank's columns; b: plain,
    identical everywhere. The loss is quadratic, so every gradient depends on the rank's own slice
    and tp peers' gradients differ.
    """

    def __init__(self, mesh, tp_rank: int) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor, Replicate, Shard

        w_full, u_full, v_full = ints((8, 3), 1), ints((4, 3), 2), ints((3, 4), 3)
        self.w = torch.nn.Parameter(DTensor.from_local(w_full.chunk(2)[tp_rank].clone(), mesh["tp"], [Shard(0)]))
        self.u = torch.nn.Parameter(DTensor.from_local(u_full.chunk(2)[tp_rank].clone(), mesh, [Replicate(), Shard(0)]))
        self.v = torch.nn.Parameter(v_full.chunk(2, dim=1)[tp_rank].clone())
        self.b = torch.nn.Parameter(ints((3,), 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.b
        return (
            0.5 * (h @ self.w.to_local().T).pow(2).sum()
            + 0.5 * (h @ self.u.to_local().T).pow(2).sum()
            + 0.5 * (h @ self.v).pow(2).sum()
        )


def local_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: rr._call.local_tensor(p.grad).clone() for name, p in model.named_parameters()}


def _averager_dp_only(rank: int, ws: int, cap_mb: float, view: bool) -> None:
    from torch.distributed.tensor import DTensor

    mesh = mesh_2d()
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    dp_group, tp_group = mesh["dp"].get_group(), mesh["tp"].get_group()
    ref, ours = TPModel(mesh, tp_rank), TPModel(mesh, tp_rank)
    avg = rr.GradientAverager(ours, mesh=mesh["dp"], bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb,
                              gradient_as_bucket_view=view)
    assert len(avg.bucket_sizes) == (4 if cap_mb < 1 else 1)
    assert sum(avg.bucket_sizes) == 4 * 3 + 2 * 3 + 3 * 2 + 3  # local shards, not global shapes
    for step in range(3):
        set_to_none = step != 1  # step 1 accumulates into existing (DTensor) gradients in place
        ref.zero_grad(set_to_none=set_to_none)
        ours.zero_grad(set_to_none=set_to_none)
        x = ints((4, 3), 100 * step + dp_rank)  # tp peers share the batch, dp peers do not
        ref(x).backward()
        ours(x).backward()
        expected = {name: dp_average(g, dp_group) for name, g in local_grads(ref).items()}
        for i, (name, p) in enumerate(ours.named_parameters()):
            got = rr._call.local_tensor(p.grad)
            assert torch.equal(got, expected[name]), f"step {step} {name}: {got} != {expected[name]}"
            if isinstance(p, DTensor):
                assert isinstance(p.grad, DTensor), f"{name}: the gradient is no longer a DTensor"
                assert p.grad.placements == p.placements and p.grad.device_mesh == p.device_mesh, name
                assert p.grad.shape == p.shape, name
            else:
                assert type(p.grad) is torch.Tensor, name
            if view:
                assert got.data_ptr() == avg._slots[i].data_ptr(), f"{name}: not a view of its bucket"
            dp_peers = gather_inputs(got, dp_group)
            assert torch.equal(dp_peers[0], dp_peers[1]), f"{name}: dp peers differ"
            tp_peers = gather_inputs(got, tp_group)
            if name != "b":
                assert not torch.equal(tp_peers[0], tp_peers[1]), f"{name}: tp peers' gradients were averaged too"
        assert not torch.equal(local_grads(ref)["w"], rr._call.local_tensor(ours.w.grad)), "dp peers had equal grads"
    avg.remove()


# Over tcp (ranks.py's Note [Places]) one bucket, and one bucket per parameter as views.
@place_cases("cap_mb,view", [(25.0, False), (1e-6, False), (1e-6, True)], tcp=[(25.0, False), (1e-6, True)])
def test_averager_over_dp_leaves_tp_alone(cap_mb: float, view: bool) -> None:
    run_ranks(WS, _averager_dp_only, cap_mb, view)


def _unused_dtensor(rank: int, ws: int) -> None:
    """A DTensor parameter used on one dp rank only gets a DTensor gradient created by the averager."""
    from torch.distributed.tensor import DTensor

    mesh = mesh_2d()
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = TPModel(mesh, tp_rank)
    avg = rr.GradientAverager(model, mesh=mesh["dp"])
    x = ints((4, 3), 7 + dp_rank)
    h = x + model.b
    loss = 0.5 * (h @ model.v).pow(2).sum()
    if dp_rank == 0:
        loss = loss + (h @ model.w.to_local().T).sum()
    loss.backward()
    g = model.w.grad
    assert isinstance(g, DTensor) and g.placements == model.w.placements, type(g)
    # d/dw of sum(h @ w.T) is the column sums of h in every row of w's local shard (4 x 3)
    local = h.detach().sum(0).expand(4, 3) if dp_rank == 0 else torch.zeros(4, 3)
    assert torch.equal(g.to_local(), dp_average(local, mesh["dp"].get_group()))
    assert model.u.grad is None, "no rank used u: its gradient must stay None"
    avg.remove()


def test_dtensor_used_on_one_dp_rank_only() -> None:
    run_ranks(WS, _unused_dtensor)


# ------------------------------------------------------------------------ collectives on meshes


def _mesh_groups(rank: int, ws: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    mesh = mesh_2d()
    mesh3 = mesh_of((2, 1, 2), ("dp", "cp", "tp"))
    base = torch.arange(37, dtype=torch.float32) * 3 % 11 - 5 + rank * 7
    cases = [
        ("dp", mesh["dp"], mesh["dp"].get_group()),
        ("tp", mesh["tp"], mesh["tp"].get_group()),
        ("2-D flattened", mesh, None),
        ("3-D dp,cp", mesh3["dp", "cp"], mesh3["dp"].get_group()),
        ("3-D cp,tp", mesh3["cp", "tp"], mesh3["tp"].get_group()),
        ("3-D dp,cp,tp", mesh3, None),
    ]
    results = {}
    for name, group, ref_group in cases:
        t = base.clone()
        rr.all_reduce_avg(t, group=group)
        assert torch.equal(t, dp_average(base, ref_group)), f"{name}: {t[:4]}"
        results[name] = t
        s = base.clone()
        rr.all_reduce(s, group=group)
        expected = gather_inputs(base, ref_group).to(torch.float64).sum(0).to(torch.float32)
        assert torch.equal(s, expected), f"{name} SUM"
    assert not torch.equal(results["dp"], results["tp"])
    assert torch.equal(results["dp"], results["3-D dp,cp"])
    # a size-1 dimension: nothing to reduce
    t = base.clone()
    rr.all_reduce_avg(t, group=mesh3["cp"])
    assert torch.equal(t, base)
    # a DTensor is reduced through its local shard, in place, keeping its placements
    d = DTensor.from_local(base.clone().reshape(37, 1), mesh["tp"], [Shard(0)])
    before = d._local_tensor
    rr.all_reduce_avg(d, group=mesh["dp"])
    assert d._local_tensor is before and d.placements == (Shard(0),)
    assert torch.equal(d.to_local().reshape(-1), results["dp"])
    work = rr.all_reduce(d, op="sum", group=mesh["dp"], async_op=True)
    work.wait()
    assert torch.equal(d.to_local().reshape(-1), results["dp"] * 2)
    # reduce_scatter / all_gather / coalesced take DTensors through their local shards too
    g = rr.all_gather(d, group=mesh["dp"])
    assert torch.equal(g, gather_inputs(d.to_local(), mesh["dp"].get_group()).reshape(74, 1))
    blocks = DTensor.from_local(base[:36].clone(), mesh["tp"], [Shard(0)])
    mine = torch.empty(18)
    rr.reduce_scatter(mine, blocks, group=mesh["dp"])
    dp_rank = dist.get_rank(mesh["dp"].get_group())
    summed = gather_inputs(base[:36], mesh["dp"].get_group()).sum(0)
    assert torch.equal(mine, summed[18 * dp_rank:18 * (dp_rank + 1)])
    c1 = DTensor.from_local(base[:5].clone(), mesh["tp"], [Shard(0)])
    rr.all_reduce_coalesced([c1, base[5:9].clone()], group=mesh["dp"])
    assert torch.equal(c1.to_local(), gather_inputs(base[:5], mesh["dp"].get_group()).sum(0))
    # the autograd-aware gather over a mesh dimension
    x = base[:4].clone().requires_grad_(True)
    out = rr.nn.all_gather(x, group=mesh["tp"])
    assert torch.equal(out.detach(), gather_inputs(base[:4], mesh["tp"].get_group()).reshape(-1))
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))


def test_collectives_on_mesh_dimensions_and_dtensors() -> None:
    run_ranks(WS, _mesh_groups)


# ------------------------------------------------------------------------------------ placements


def _placements(rank: int, ws: int) -> dict:
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = mesh_2d()
    dp_rank = mesh.get_local_rank("dp")
    out = {}
    # Partial on tp (not averaged): the local partial sums are averaged over dp and stay Partial.
    p = torch.nn.Parameter(DTensor.from_local(ints((2, 3), 5), mesh, [Replicate(), Replicate()]))
    avg = rr.GradientAverager([p], mesh=mesh["dp"])
    x = ints((2, 3), 50 + rank)
    (p.to_local(grad_placements=[Replicate(), Partial()]) * x).sum().backward()
    out["tp_partial_placements"] = p.grad.placements == (Replicate(), Partial())
    out["tp_partial_value"] = torch.equal(p.grad.to_local(), dp_average(x, mesh["dp"].get_group()))
    avg.remove()
    # Partial on dp (averaged): refused on every rank, before anything is launched.
    q = torch.nn.Parameter(DTensor.from_local(ints((2, 3), 6), mesh, [Replicate(), Replicate()]))
    avg = rr.GradientAverager([q], mesh=mesh["dp"])
    try:
        (q.to_local(grad_placements=[Partial(), Replicate()]) * x).sum().backward()
        out["dp_partial"] = "did not raise"
    except RuntimeError as exc:
        out["dp_partial"] = "ok" if "Partial" in str(exc) and "dp" in str(exc) else str(exc)
    avg.remove()
    # Arguments.
    try:
        rr.GradientAverager([p], group=dist.group.WORLD, mesh=mesh["dp"])
        out["both"] = "did not raise"
    except ValueError as exc:
        out["both"] = "ok" if "either group or mesh" in str(exc) else str(exc)
    try:
        rr.GradientAverager([p], mesh="dp")
        out["not_a_mesh"] = "did not raise"
    except TypeError as exc:
        out["not_a_mesh"] = "ok" if "DeviceMesh" in str(exc) else str(exc)
    # The ranks still agree afterwards.
    t = torch.full((5,), float(dp_rank))
    rr.all_reduce_avg(t, group=mesh["dp"])
    out["still_works"] = torch.equal(t, torch.full((5,), 0.5))
    return out


def test_partial_placements_and_bad_arguments() -> None:
    for r in run_ranks(WS, _placements):
        assert r == {
            "tp_partial_placements": True,
            "tp_partial_value": True,
            "dp_partial": "ok",
            "both": "ok",
            "not_a_mesh": "ok",
            "still_works": True,
        }, r
