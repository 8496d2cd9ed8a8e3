"""bench.link_timeline: the copies it times, and what it makes of them (no GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

from bench.link_timeline import FIELDS, LinkTimeline, busy
from offload import CPUOffloadOptimizer


class _Event:
    """A device event at a given time (ms)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: _Event) -> float:
        return other.t - self.t


def test_busy_is_the_union_of_the_intervals_within_the_window():
    assert busy([(0, 4), (2, 6), (8, 9)], 0, 10) == 7
    assert busy([(0, 4), (2, 6), (8, 9)], 3, 8.5) == 3.5
    assert busy([(12, 20), (-5, -1)], 0, 10) == 0  # wholly outside
    assert busy([], 0, 10) == 0


def test_summary_sets_the_copies_against_each_steps_phases():
    timeline = LinkTimeline.__new__(LinkTimeline)  # its copies set by hand below
    timeline._copies = []
    steps = []
    forwards = (80, 70, 76, 90)  # only steps 1 and 2 have a step before and after them
    for k, forward in enumerate(forwards):  # each 200 ms, the backward to 190
        t = 200 * k
        steps.append([_Event(t + x) for x in (0, 5, 60, forward, 190, 195)])
        # the forward's loads: one in step() before it (-8 to -2), then 10-18, 20-28, ...
        timeline._copies.append(("load", _Event(t - 8), _Event(t - 2)))
        for j in range(1, 5):
            timeline._copies.append(("load", _Event(t + 10 * j), _Event(t + 10 * j + 8)))
            timeline._copies.append(("write_back", _Event(t + 10 * j + 9), _Event(t + 10 * j + 15)))
        timeline._copies.append(("load", _Event(t + 100), _Event(t + 130)))  # in the backward
    summary = timeline.summary(steps)
    assert list(summary) == list(FIELDS)
    assert summary == {
        "forward_ms": 73,  # steps 1 and 2 (with step 0 or 3 too, 76)
        "h2d_busy_forward_ms": 32,  # the one in step() ended before the forward began
        "d2h_busy_forward_ms": 24,
        "first_load_ms": -8,
        "last_load_done_ms": 48,
        "backward_ms": 117,
        "h2d_busy_backward_ms": 30,
        "d2h_busy_backward_ms": 0,
    }
    assert timeline.summary(steps[:3])["forward_ms"] == 70  # step 1 alone
    assert timeline.summary(steps[:2]) is None  # no step both before and after one


def test_it_times_every_load_and_write_back_and_close_takes_its_wrappers_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()),
        chunk_bytes=2 * 8 * 9 * 4,
        staging_slots=2,
        overlap_forward=model,
    )
    clock = itertools.count()

    def step():
        opt.zero_grad()
        model(torch.randn(3, 8)).square().sum().backward()
        opt.step()

    step()  # the first step creates the state: nothing to load
    opt.wait_for_optimizer_step()  # its write-backs too
    timeline = LinkTimeline(opt, lambda stream: _Event(next(clock)))
    step()
    opt.wait_for_optimizer_step()
    staged = len(opt.schedule.staged)
    kinds = [kind for kind, *_ in timeline._copies]
    assert staged > 2 and kinds.count("load") == kinds.count("write_back") == staged
    assert all(a.t < b.t for _, a, b in timeline._copies)
    timeline.close()
    executor = opt._executor
    assert "_load" not in vars(executor) and "_write_back" not in vars(executor)
    step()
    opt.wait_for_optimizer_step()
    assert len(timeline._copies) == 2 * staged  # not timed once closed


def test_the_bench_asks_for_the_phases_it_needs():
    from bench.train_step import parse_args

    with pytest.raises(SystemExit, match="give --phases"):
        parse_args(["--link-timeline"])
    with pytest.raises(SystemExit, match="give --device cuda"):
        parse_args(["--link-timeline", "--phases", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--steps >= 3"):
        parse_args(["--link-timeline", "--phases", "--steps", "2"])
    assert parse_args(["--link-timeline", "--phases"]).link_timeline


def test_runs_merge_as_medians_and_the_table_prints_them(capsys):
    from bench.phases import PHASES
    from bench.train_step import _print_phases, merge_runs

    def run(ms: float, forward: float) -> dict:
        return {
            "arm": "adamw/offload+overlap",
            "step_ms": ms,
            "phases": {p: {"device_ms": 1.0, "host_ms": 1.0} for p in PHASES},
            "link_timeline": {f: forward if f == "forward_ms" else 1.0 for f in FIELDS},
        }

    (merged,) = merge_runs([run(200, 90), run(210, 100), run(220, 95)])
    assert merged["link_timeline"]["forward_ms"] == 95

    _print_phases([merged], 24)
    assert "the host link in its forward of 95.0 ms (device): host to GPU busy 1.0" in (
        capsys.readouterr().out
    )
