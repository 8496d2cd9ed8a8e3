"""Benches that time arms in rounds: every arm once a round, ratios paired within a round,
the rounds' spread beside each ratio, the copy floor warmed up before it is timed."""

from __future__ import annotations

import time

import pytest
import torch

from bench.timing import in_rounds, synced_seconds


def test_rounds_run_every_arm_in_turn_and_keep_each_rounds_result():
    calls = []

    def arm(name):
        def run():
            calls.append(name)
            return f"{name}{calls.count(name)}"

        return run

    results = in_rounds({"floor": arm("floor"), "a": arm("a"), "b": arm("b")}, rounds=2)
    assert calls == ["floor", "a", "b", "floor", "a", "b"]
    assert results == {"floor": ["floor1", "floor2"], "a": ["a1", "a2"], "b": ["b1", "b2"]}


def test_synced_seconds_times_only_the_calls_after_the_warmup():
    """The first copy on a fresh buffer pays its setup: a warmup keeps it out of the floor."""
    calls = []

    def copy():
        if not calls:
            time.sleep(0.2)  # the cold first call
        calls.append(1)

    samples = synced_seconds(copy, torch.device("cpu"), warmup=1, repeats=3)
    assert len(calls) == 4 and len(samples) == 3
    assert max(samples) < 0.1


def _round(step_s: float, peak: float) -> dict[str, float]:
    return {"step_s": step_s, "host_s": step_s / 10, "peak_gib": peak}


def test_offload_step_ratios_pair_each_arm_with_the_floor_of_its_own_round():
    from bench.offload_step import FLOOR_ARM, offload_rows

    floor_s = [0.20, 0.25]
    arms = {
        "no offload": [_round(0.02, 20.0), _round(0.03, 21.0)],
        "serial offload": [_round(0.40, 20.0), _round(0.50, 20.0)],
        "chunked": [_round(0.21, 9.0), _round(0.24, 9.5)],
    }
    floor, _, serial, chunked = offload_rows(floor_s, arms)
    assert floor["arm"] == FLOOR_ARM and floor["host_s"] is None and floor["peak_gib"] is None
    assert floor["step_s_rounds"] == floor_s and floor["vs_floor_rounds"] == [1.0, 1.0]
    assert floor["serial_speedup_rounds"] == pytest.approx([2.0, 2.0])
    assert chunked["step_s"] == pytest.approx(0.225)
    assert chunked["vs_floor_rounds"] == pytest.approx([1.05, 0.96])
    # the median of the rounds' ratios, not the ratio of the medians (0.225 / 0.225)
    assert chunked["vs_floor"] == pytest.approx(1.005)
    assert chunked["serial_speedup_rounds"] == pytest.approx([0.40 / 0.21, 0.50 / 0.24])
    assert chunked["peak_gib"] == 9.5 and chunked["peak_gib_rounds"] == [9.0, 9.5]
    assert serial["serial_speedup_rounds"] == [1.0, 1.0]


def test_muon_offload_ratios_pair_each_round_and_keep_the_rounds():
    from bench.muon_offload_step import set_summary

    floor = [
        {"h2d_s": 0.15, "d2h_s": 0.14, "both_s": 0.20},
        {"h2d_s": 0.13, "d2h_s": 0.12, "both_s": 0.24},
    ]
    unwrapped = [_round(0.25, 27.0), _round(0.22, 27.2)]
    offloaded = [_round(0.26, 18.9), _round(0.23, 18.9)]
    r = set_summary(floor, unwrapped, offloaded)
    assert r["unwrapped_ms_rounds"] == pytest.approx([250.0, 220.0])
    assert r["copy_floor_ms_rounds"] == pytest.approx([200.0, 240.0])
    assert r["offloaded_vs_unwrapped_rounds"] == pytest.approx([0.26 / 0.25, 0.23 / 0.22])
    # each round's offloaded step over that round's max(floor, unwrapped)
    assert r["offloaded_vs_floor_rounds"] == pytest.approx([0.26 / 0.25, 0.23 / 0.24])
    assert r["offloaded_vs_floor"] == pytest.approx((0.26 / 0.25 + 0.23 / 0.24) / 2)
    assert r["unwrapped_peak_gib"] == 27.2 and r["offloaded_peak_gib"] == 18.9
    assert r["copy_h2d_ms"] == pytest.approx(140.0) and r["copy_d2h_ms"] == pytest.approx(130.0)
