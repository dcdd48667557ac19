"""GradientAverager under torch.distributed.algorithms.Join (uneven inputs): equal to DDP under Join.

Three ranks hold 3, 5 and 7 batches. The exact case uses a loss linear in the parameters with
integer inputs scaled so that every gradient is a multiple of 6: sums, divisions by 3, 2 or 1 and
DDP's pre-division are all exact, so the parameters must equal DDP's bitwise. A small MLP on
random data is compared with tolerances as well.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as tF
from ranks import run_ranks
from test_hooks import assert_identical_across_ranks
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import ringreduce as rr

BATCHES = (3, 5, 7)  # per rank


class ExactNet(nn.Module):
    """Returns a loss linear in the parameters: every gradient is 6 x (sums of integer inputs or
    batch counts), whatever the parameters, so averaging and SGD with lr 1/64 stay exact."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 3)
        self.second = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        return (h * 6.0).sum() + (self.second(torch.ones_like(h)) * 6.0).sum()


def _linear(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ExactNet().double()


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2)).double()


def _exact_batch(rank: int, step: int) -> torch.Tensor:
    """Position-dependent small integers."""
    return (torch.arange(8, dtype=torch.float64).reshape(2, 4) + 3 * rank + step) % 7 - 3


def _random_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 2, generator=g, dtype=torch.float64)


def _train(model: nn.Module, wrapped: nn.Module, joinable: object, rank: int, exact: bool, accumulate: int,
           no_sync: object, join_kwargs: dict) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=1.0 / 64)
    with Join([joinable], **join_kwargs):
        for step in range(BATCHES[rank]):
            sync = (step + 1) % accumulate == 0
            ctx = no_sync() if not sync else torch.enable_grad()
            with ctx:
                if exact:
                    loss = wrapped(_exact_batch(rank, step))
                else:
                    x, y = _random_batch(rank, step)
                    loss = tF.mse_loss(wrapped(x), y)
                loss.backward()
            if sync:
                opt.step()
                opt.zero_grad(set_to_none=True)


def _join_parity(rank: int, ws: int, exact: bool, divide: bool, accumulate: int) -> None:
    assert ws == len(BATCHES)
    make = _linear if exact else _mlp
    join_kwargs = {"divide_by_initial_world_size": divide}
    ours = make()
    averager = rr.GradientAverager(ours, bucket_cap_mb=1e-5, first_bucket_mb=1e-5)  # one bucket per parameter
    assert len(averager.bucket_sizes) > 1
    _train(ours, ours, averager, rank, exact, accumulate, averager.no_sync, join_kwargs)
    ref = make()
    ddp = DDP(ref, bucket_cap_mb=1e-4)
    _train(ref, ddp, ddp, rank, exact, accumulate, ddp.no_sync, join_kwargs)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        assert_identical_across_ranks(p.detach(), f"averager+Join {name}")
        if exact:
            assert torch.equal(p.detach(), q.detach()), f"{name}: averager+Join differs from DDP+Join:\n{p}\n{q}"
        else:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)
    # the averager works as before once the Join context is over (every rank trains again)
    x = torch.ones(2, 4, dtype=torch.float64) * (rank + 1)
    for p in ours.parameters():
        p.grad = None
    (ours(x) if exact else ours(x).sum()).backward()
    for p in ours.parameters():
        assert_identical_across_ranks(p.grad, "gradient after Join")


@pytest.mark.parametrize(("exact", "divide", "accumulate"), [
    (True, True, 1),
    (True, False, 1),
    (True, True, 2),
    (False, True, 1),
])
def test_join_uneven_inputs_equals_ddp(exact: bool, divide: bool, accumulate: int) -> None:
    run_ranks(3, _join_parity, exact, divide, accumulate, timeout=240)


def _early_termination(rank: int, ws: int) -> str:
    model = _linear()
    averager = rr.GradientAverager(model)
    try:
        with Join([averager], throw_on_early_termination=True):
            for step in range(BATCHES[rank]):
                model(_exact_batch(rank, step)).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_join_throw_on_early_termination() -> None:
    messages = run_ranks(3, _early_termination, timeout=120)
    assert "exhausted all inputs" in messages[0], messages
    for m in messages[1:]:
        assert "Detected at least one rank that exhausted inputs" in m, messages


def _join_errors(rank: int, ws: int) -> None:
    model = _linear()
    averager = rr.GradientAverager(model)
    with pytest.raises(TypeError, match="divide_by_initial_world_size"):
        Join([averager], divide_by_initial_world_size="yes")
    assert averager.join_process_group is dist.group.WORLD
    assert averager.join_device == torch.device("cpu")


def test_join_bad_arguments() -> None:
    run_ranks(2, _join_errors)
