"""The benchmark plot's ratio axis: ticks label the range the data has (ringreduce.bench.plot.ratio_ticks)."""

from __future__ import annotations

import pytest

from ringreduce.bench.plot import ratio_ticks


def test_small_ratios_get_ticks_where_the_data_is() -> None:
    # The Quickstart's 2-rank CPU run: ratios 0.02-0.13; the plot's limits are min(0.9, ...) * 0.9 and
    # max(1.15, ...) * 1.25. A fixed list labelled only 0.25-1 there.
    ratios = [0.021, 0.035, 0.06, 0.13]
    low, high = min(min(ratios), 0.9) * 0.9, max(max(ratios), 1.15) * 1.25
    ticks = ratio_ticks(low, high)
    assert ticks == [0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
    assert len([t for t in ticks if min(ratios) <= t <= max(ratios)]) >= 2


@pytest.mark.parametrize("low,high", [(0.018, 1.44), (0.5, 40.0), (0.81, 2.5), (1e-4, 100.0), (0.2, 0.45),
                                      (3.0, 700.0), (0.07, 0.3)])
def test_ticks_lie_in_the_range_and_are_few_enough(low: float, high: float) -> None:
    ticks = ratio_ticks(low, high)
    assert ticks == sorted(set(ticks))
    assert all(low <= t <= high for t in ticks)
    assert 2 <= len(ticks) <= 12, ticks
    # Every factor of 10 of the range holds a tick: no stretch of the axis is left unlabelled.
    assert ticks[0] <= low * 10 and ticks[-1] >= high / 10


def test_bad_limits_raise() -> None:
    with pytest.raises(ValueError):
        ratio_ticks(0.0, 1.0)
    with pytest.raises(ValueError):
        ratio_ticks(2.0, 1.0)
