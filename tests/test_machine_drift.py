"""bench.machine_drift's stretch and summary arithmetic (pure; the sampling needs CUDA)."""

from __future__ import annotations

import pytest

from bench.machine_drift import longest_slow_stretch, summary


def test_the_longest_slow_stretch_runs_from_its_first_slow_sample_to_the_next_fast_one():
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    rates = [50.0, 50.0, 30.0, 30.0, 50.0, 30.0, 50.0, 50.0]  # fastest tenth 50; slow below 41.7
    assert longest_slow_stretch(times, rates, higher_is_slower=False) == 2.0
    loop_ms = [1.0, 1.0, 1.3, 1.0, 1.0, 1.0, 1.3, 1.3, 1.3]  # fastest tenth 1.0; slow above 1.2
    assert longest_slow_stretch([*times, 8.0], loop_ms, higher_is_slower=True) == 2.0  # to the end


def test_a_sample_just_inside_the_bound_is_not_slow():
    times = [0.0, 1.0, 2.0]
    assert longest_slow_stretch(times, [50.0, 50.0, 50.0 / 1.19], higher_is_slower=False) == 0.0


def test_summary_counts_the_slow_share_and_spread():
    times = [float(t) for t in range(10)]
    rates = [50.0] * 7 + [20.0] * 3
    s = summary(times, rates, higher_is_slower=False)
    assert s["median"] == 50.0 and s["min"] == 20.0 and s["max"] == 50.0
    assert s["slow_share"] == pytest.approx(0.3)
    assert s["longest_slow_s"] == 2.0


def test_a_machine_slow_most_of_the_time_counts_slow_against_its_fastest_tenth():
    times = [float(t) for t in range(10)]
    loop_ms = [0.7, 0.7] + [1.2] * 8  # the median is the slow speed
    s = summary(times, loop_ms, higher_is_slower=True)
    assert s["slow_share"] == pytest.approx(0.8)
    assert s["longest_slow_s"] == 7.0
