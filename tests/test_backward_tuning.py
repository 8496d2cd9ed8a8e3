"""The default's backward loads grow to what the forward stalls for (`offload.backward_tuning`),
on the CPU with made-up times (`FakeTuningTimer`): exact, and sized by the stall."""

from __future__ import annotations

import doctest
import logging
import re

import pytest
import torch
from fake_step_timer import FakeTuningTimer
from test_offload import assert_same_state, make_model, train

import offload.backward_tuning
import offload.cpu_offload
from offload import CPUOffloadOptimizer
from offload.backward_tuning import (
    FASTER_ENOUGH,
    STALL_FLOOR_FRACTION,
    TUNING_STEPS_AT_MOST,
    BackwardTuning,
    grown_backward_bytes,
)
from offload.residency import BACKWARD_LOAD_SHARE

RATE = 100.0  # bytes per ms the fake loads copy
BACKWARD_MS = 400.0  # carries 26000 bytes: more than the state
STEPS = TUNING_STEPS_AT_MOST + 2
SLOT_BYTES = 1024  # a ring slot of `_tuned`'s plans: chunk_bytes=1000, aligned


def _loaded_in_backward(opt: CPUOffloadOptimizer) -> int:
    return sum(opt.plan.chunks[c].invariant_bytes for c in opt.schedule.loaded_in_backward)


def _tuned(stall_ms, backward_ms=BACKWARD_MS, held=None, iteration_ms=None, **options):
    """Overlapped AdamW (chunks of 1000 bytes, a ring of 2, `options`), its tuning timed by
    `stall_ms(opt, first_loaded)`, `backward_ms` (a number, or called as `stall_ms`) and
    `iteration_ms` (None: 100 ms; or called as `stall_ms`),
    trained beside plain AdamW: bit-equal, in the pinned slabs it had. Returns the
    optimizer and the bytes its backward loaded at first; each plan's GPU bytes for state
    go into the list `held`."""
    plain_model, model = make_model(), make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=1000,
        staging_slots=2,
        overlap_forward=model,
        **options,
    )
    assert opt._tuning is not None  # the CPU times nothing: a made-up timer here
    first, slabs = [], []
    opt._tuning = BackwardTuning(
        lambda: FakeTuningTimer(
            lambda: stall_ms(opt, first[0]),
            (lambda: backward_ms(opt, first[0])) if callable(backward_ms) else backward_ms,
            RATE,
            *([lambda: iteration_ms(opt, first[0])] if iteration_ms is not None else []),
        )
    )
    real_build = opt._build

    def build(*args, **kwargs):
        real_build(*args, **kwargs)
        if not first:
            first.append(_loaded_in_backward(opt))
        slabs.append({d: t.data_ptr() for d, t in opt._executor.host_slabs.items()})
        if held is not None:
            held.append(opt.plan.held_bytes(opt.schedule.slots, opt.schedule.ring_slots))

    opt._build = build
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    train(plain_model, plain, steps=STEPS)
    train(model, opt, steps=STEPS)
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert_same_state(plain, opt)
    assert all(s == slabs[0] for s in slabs)  # re-planned in the pinned slabs it had
    return opt, first[0]


def test_the_backward_loads_what_the_forward_stalled_for_and_stops_once_it_is_gone(caplog):
    """6 ms of stall at 100 bytes/ms: the backward loads 600 bytes more (whole chunks, up),
    the stall is gone at the check, and the tuning stops there."""

    def stall(opt, first):
        return max(0.0, 6.0 - (_loaded_in_backward(opt) - first) / RATE)

    with caplog.at_level(logging.INFO, logger="offload.cpu_offload"):
        opt, first = _tuned(stall)
    grown, check = opt.backward_tuning
    assert grown.stall_ms == 6.0 and grown.loaded_bytes == first
    assert grown.held_back_by is None  # it took all the stall carries
    assert first + 600 <= grown.chosen_bytes < first + 600 + 1000  # rounded up to a chunk
    assert check.stall_ms == 0.0 and check.chosen_bytes == check.loaded_bytes
    assert _loaded_in_backward(opt) == check.loaded_bytes > first
    assert opt._tuning is None and not opt._load_first_wait
    assert "load_in_backward's default loads" in caplog.text


def test_a_round_that_took_back_too_little_of_the_stall_is_undone():
    """A stall the loads do not shorten (an update's own time) goes back to what ran."""
    opt, first = _tuned(lambda opt, first: 6.0)
    grown, undone = opt.backward_tuning
    assert grown.chosen_bytes > first
    assert undone.chosen_bytes == first and _loaded_in_backward(opt) == first


def test_a_round_that_lengthened_the_backward_as_much_as_it_shortened_the_stall_is_undone():
    """The loads moved into the backward took as long there as the forward waited less
    (measured on an H100: stall 53.8 -> 29.6 ms, backward 136 -> 186 ms): undone."""

    def moved_ms(opt, first):
        return (_loaded_in_backward(opt) - first) / RATE

    opt, first = _tuned(
        lambda opt, first: max(0.0, 6.0 - moved_ms(opt, first)),
        lambda opt, first: BACKWARD_MS + moved_ms(opt, first),
    )
    grown, undone = opt.backward_tuning
    assert grown.chosen_bytes > first and undone.stall_ms == 0.0
    assert undone.chosen_bytes == first and _loaded_in_backward(opt) == first


def test_a_round_that_made_the_step_faster_is_kept_though_its_stall_fell_less():
    """The loads moved into the backward also spared the forward what its waits do not
    show (the trainer's copies queued behind them). Measured on an H100 (AdamW, batch 4):
    2.38 GiB moved (50 ms of loads), stall 64.1 -> 25.3 ms, backward 110.8 -> 139.4 ms, step
    253.9 -> 241.7 ms; undone by the stall less the backward, the run's steps took
    264.7 ms. Kept by the step's time."""

    def moved_ms(opt, first):
        return (_loaded_in_backward(opt) - first) / RATE

    def stall(opt, first):  # takes back a fifth of what moved: under half
        return max(0.0, 6.0 - 0.2 * moved_ms(opt, first))

    opt, first = _tuned(
        stall,
        lambda opt, first: BACKWARD_MS + 0.7 * moved_ms(opt, first),
        iteration_ms=lambda opt, first: 100.0 - 0.5 * moved_ms(opt, first),
    )
    grown, checked, *_ = opt.backward_tuning
    assert grown.chosen_bytes > first and checked.loaded_bytes == grown.chosen_bytes
    assert checked.iteration_ms <= grown.iteration_ms * (1 - FASTER_ENOUGH)
    assert _loaded_in_backward(opt) >= grown.chosen_bytes
    # by the stall less the backward alone it would be undone
    moved = (grown.chosen_bytes - grown.loaded_bytes) / RATE
    took_back = grown.stall_ms - checked.stall_ms - (checked.backward_ms - grown.backward_ms)
    assert took_back < 0.5 * min(grown.stall_ms, moved)


def test_a_one_off_in_one_timed_step_does_not_keep_a_round():
    """One step of a round may carry a one-off cost (a collection, a late launch): the
    round's step is the median of its timed steps, so a round after it is not faster."""
    step_ms = iter([130.0] + [100.0] * 40)  # the first round's first step carries 30 ms once
    opt, first = _tuned(lambda opt, first: 6.0, iteration_ms=lambda opt, first: next(step_ms))
    grown, undone = opt.backward_tuning
    assert grown.chosen_bytes > first and grown.iteration_ms == undone.iteration_ms == 100.0
    assert undone.chosen_bytes == first and _loaded_in_backward(opt) == first


def test_a_round_whose_step_got_faster_is_kept_though_its_stall_did_not_fall():
    """Measured on an H100 (Muon, batch 4): with every chunk moved into the backward the
    forward still stalled for the update's own time (52.5 -> 53.7 ms), yet the step ran
    291.8 -> 265.9 ms; undone by the stall, the run's steps took 297.7 ms. The bytes
    before it run a round again, slower: it is kept."""

    def step(opt, first):  # 9% faster once more loads in the backward
        return 100.0 - 9.0 * (_loaded_in_backward(opt) > first)

    opt, first = _tuned(lambda opt, first: 6.0, iteration_ms=step)
    grown, faster, checked = opt.backward_tuning
    assert grown.chosen_bytes > first and faster.stall_ms == grown.stall_ms
    assert faster.iteration_ms == 91.0 and faster.chosen_bytes == first  # checked next
    assert checked.loaded_bytes == first and checked.iteration_ms == 100.0
    assert checked.chosen_bytes == grown.chosen_bytes == _loaded_in_backward(opt)


def test_a_run_whose_early_steps_were_slower_keeps_no_round_for_it():
    """A run's first steps may just be getting faster (found by a review): the round
    after them looks faster with a stall that did not fall. Its bytes undone for a round,
    the step is no slower, so they stay undone."""
    step_ms = iter([106.0, 104.0, 103.0] + [100.0] * 60)
    opt, first = _tuned(lambda opt, first: 6.0, iteration_ms=lambda opt, first: next(step_ms))
    grown, faster, checked = opt.backward_tuning
    assert grown.chosen_bytes > first and grown.iteration_ms == 104.0
    assert faster.iteration_ms == 100.0 and faster.chosen_bytes == first
    assert checked.chosen_bytes == checked.loaded_bytes == first == _loaded_in_backward(opt)


def test_a_round_kept_for_its_step_is_not_taken_back_where_the_device_no_longer_holds_it(
    monkeypatch,
):
    """Its bytes undone for a round, the device's headroom is gone: they stay undone."""
    headroom = [2**40]
    monkeypatch.setattr(offload.cpu_offload, "device_headroom_bytes", lambda d: headroom[0])

    def step(opt, first):
        loaded = _loaded_in_backward(opt)
        if opt.backward_tuning is None and len(opt._tuning.rounds) == 2:
            headroom[0] = 0  # while the bytes before it run again
        return 100.0 - 9.0 * (loaded > first)

    opt, first = _tuned(lambda opt, first: 6.0, iteration_ms=step)
    grown, faster, checked = opt.backward_tuning
    assert faster.chosen_bytes == first and checked.iteration_ms == 100.0
    assert checked.chosen_bytes == first == _loaded_in_backward(opt)
    assert checked.held_back_by == "the device's headroom"  # said in the log line (review)


def test_a_round_faster_by_less_than_the_noise_is_undone():
    """A step 1.5% faster (under `FASTER_ENOUGH`) beside a stall that did not fall."""
    assert FASTER_ENOUGH > 0.015

    def step(opt, first):
        return 100.0 - 1.5 * (_loaded_in_backward(opt) > first)

    opt, first = _tuned(lambda opt, first: 6.0, iteration_ms=step)
    grown, undone = opt.backward_tuning
    assert grown.chosen_bytes > first and undone.chosen_bytes == first
    assert _loaded_in_backward(opt) == first


def test_it_grows_no_more_than_the_backward_carries_or_the_device_holds(monkeypatch):
    """The backward's share of its length at the load rate caps the growth; a device with
    no headroom grows nothing; a stall under the floor grows nothing."""
    carried = int(BACKWARD_LOAD_SHARE * 150.0 * RATE)  # 9750 bytes, all it loads
    # a stall past it, which the loads moved shorten
    opt, first = _tuned(
        lambda opt, first: 1000.0 - (_loaded_in_backward(opt) - first) / RATE, backward_ms=150.0
    )
    assert first < opt.backward_tuning[0].chosen_bytes <= carried
    assert first < _loaded_in_backward(opt) <= carried
    assert opt.backward_tuning[0].held_back_by == "the backward's length"

    floor = STALL_FLOOR_FRACTION * 100.0  # of the fake's 100 ms steps
    opt, first = _tuned(lambda opt, first: floor)
    assert [r.chosen_bytes for r in opt.backward_tuning] == [first]

    monkeypatch.setattr(offload.cpu_offload, "device_headroom_bytes", lambda device: 0)
    opt, first = _tuned(lambda opt, first: 6.0)
    assert [r.chosen_bytes for r in opt.backward_tuning] == [first]
    assert _loaded_in_backward(opt) == first
    assert opt.backward_tuning[0].held_back_by == "the device's headroom"


def test_a_gpu_budget_bounds_the_growth(caplog):
    """A stall the backward's whole length could carry, within gpu_budget_bytes: every plan
    holds no more than the budget, and the loads grow up to it."""

    def stall(opt, first):
        return 1000.0 - (_loaded_in_backward(opt) - first) / RATE

    unbounded_held: list[int] = []
    unbounded, first = _tuned(stall, held=unbounded_held)
    budget = unbounded_held[0] + 2500  # a few more chunks (slots of at most 1024 bytes)
    assert max(unbounded_held) > budget  # the tuning alone grows past it
    held: list[int] = []
    with caplog.at_level(logging.INFO, logger="offload.cpu_offload"):
        opt, bounded_first = _tuned(stall, held=held, gpu_budget_bytes=budget)
    assert "(held back by gpu_budget_bytes)" in caplog.text
    assert bounded_first == first and max(held) <= budget
    assert first < _loaded_in_backward(opt) < _loaded_in_backward(unbounded)
    assert budget - SLOT_BYTES < held[-1]  # as many as fit
    assert opt.backward_tuning[0].held_back_by == "gpu_budget_bytes"


def test_a_gpu_budget_bounds_the_tuned_loads_of_a_later_plan():
    """Grown, then re-planned with larger chunks (a Muon group switched to AdamW: its
    matrices' state grows from one buffer to two moments): the bytes the tuning chose
    would hold more than the budget there, and are cut to fit it."""
    from muon import Muon, muon_param_groups

    budget = 17000  # the regrouped plan holds 16384 with one chunk loaded, 18296 with two
    model = make_model()
    opt = CPUOffloadOptimizer(
        Muon(muon_param_groups(model), lr=1e-2, bucket_cap_bytes=256),
        chunk_bytes=1000,
        staging_slots=2,
        overlap_forward=model,
        gpu_budget_bytes=budget,
    )
    first: list[int] = []

    def stall() -> float:
        first[:] = first or [_loaded_in_backward(opt)]
        return max(0.0, 1000.0 - (_loaded_in_backward(opt) - first[0]) / RATE)

    opt._tuning = BackwardTuning(lambda: FakeTuningTimer(stall, BACKWARD_MS, RATE))
    builds = []
    build = opt._build
    opt._build = lambda step, **kw: (builds.append(step), build(step, **kw))[1]
    gen = torch.Generator().manual_seed(1)
    for step in range(TUNING_STEPS_AT_MOST + 3):
        if step == TUNING_STEPS_AT_MOST + 1:
            assert opt._tuning is None and not opt._load_first_wait  # the tuning's bytes
            grown = builds[-1].backward_load_bytes
            opt.param_groups[0]["algorithm"] = "adamw"
        opt.zero_grad()
        model(torch.randint(0, 50, (4, 6), generator=gen)).square().mean().backward()
        opt.step()
    regrouped = builds[-1]
    assert grown > first[0] and all(b.held_bytes <= budget for b in builds)
    assert regrouped.schedule.backward_loads == 1  # two would hold 18296
    opt.close()


def test_a_gpu_budget_cuts_what_the_forward_first_waits_for():
    """Under the budget the default's first loads (the embedding's chunks) are cut to fit,
    down to none where the ring alone holds more, which is said."""
    held: list[int] = []
    unbounded, first = _tuned(lambda opt, first: 0.0, held=held)
    ring = 2 * SLOT_BYTES
    assert first > 3000 and held == [ring + first + 128]  # the embedding's, slots aligned
    cut: list[int] = []
    opt, loaded = _tuned(lambda opt, first: 0.0, held=cut, gpu_budget_bytes=ring + 3000)
    assert 0 < loaded < first and ring + 3000 - SLOT_BYTES < cut[0] <= ring + 3000
    # under the ring, at it, or short of the first chunk's slot beside it: none, said
    for budget in (ring - 1, ring, ring + 300):
        with pytest.warns(UserWarning, match=f"gpu_budget_bytes={budget} leaves no room") as w:
            opt, loaded = _tuned(lambda opt, first: 0.0, gpu_budget_bytes=budget)
        assert loaded == 0
        least = int(re.search(r"Give at least (\d+) bytes", str(w[0].message)).group(1))
        assert ring < least <= ring + SLOT_BYTES
        opt, loaded = _tuned(lambda opt, first: 0.0, gpu_budget_bytes=least)
        assert loaded > 0  # the least it names loads one


@pytest.mark.parametrize(
    "options, named",
    [
        ({"gpu_resident_bytes": 7000}, r"\(gpu_resident_bytes=7000\)"),
        ({"load_in_backward": 3000}, r"\(load_in_backward=3000\)"),
        ({"load_in_backward": False}, r"\(load_in_backward=False\)"),
        (
            {"gpu_resident_bytes": 7000, "load_in_backward": 3000},
            r"\(gpu_resident_bytes=7000, load_in_backward=3000\)",
        ),
    ],
)
def test_a_gpu_budget_where_nothing_is_chosen_is_refused(options, named):
    model = make_model()
    with pytest.raises(ValueError, match=f"here nothing is chosen {named}"):
        CPUOffloadOptimizer(
            torch.optim.AdamW(model.parameters()),
            overlap_forward=model,
            gpu_budget_bytes=2**30,
            **options,
        )


@pytest.mark.parametrize(
    "options",
    [
        {"load_in_backward": False},
        {"load_in_backward": True},
        {"load_in_backward": 3000},
        # its re-plan would move resident state through host homes laid out without room
        # for it (other params' homes: found by a hostile review)
        {"gpu_resident_bytes": 7000},
    ],
)
def test_backward_loads_the_user_chose_or_resident_state_are_not_tuned(options):
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=1000, overlap_forward=model, **options
    )
    assert opt._tuning is None and opt.backward_tuning == ()


def test_the_cpu_times_nothing_and_tunes_nothing():
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=1000, overlap_forward=model
    )
    assert opt.backward_tuning is None
    train(model, opt, steps=STEPS)
    assert opt.backward_tuning == () and opt._tuning is None and opt._load_first_wait
    opt.close()


def test_a_timer_that_raises_ends_the_tuning_once():
    """An error reading the times raises from that step() only: the loads stay as they were."""
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=1000, overlap_forward=model
    )

    def broken() -> float:
        raise RuntimeError("the timer broke")

    opt._tuning = BackwardTuning(lambda: FakeTuningTimer(broken, BACKWARD_MS, RATE))
    gen = torch.Generator().manual_seed(1)
    raised = 0
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randint(0, 50, (4, 6), generator=gen)).square().mean().backward()
        try:
            opt.step()
        except RuntimeError as error:
            assert "the timer broke" in str(error)
            raised += 1
    assert raised == 1 and opt._tuning is None and opt.backward_tuning == ()
    opt.close()


def test_close_ends_the_tuning():
    """Closed between its timed steps (a timed tuning, still running), it is done."""
    model = make_model()
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters()), chunk_bytes=1000, overlap_forward=model
    )
    opt._tuning = BackwardTuning(lambda: FakeTuningTimer(lambda: 6.0, BACKWARD_MS, RATE))
    train(model, opt, steps=2)
    assert opt._tuning is not None and opt.backward_tuning is None
    opt.close()
    assert opt._tuning is None and opt.backward_tuning == ()


def test_the_examples_run():
    tests = doctest.testmod(offload.backward_tuning)
    assert tests.attempted > 0 and tests.failed == 0
    # at least what it loads, never past the whole chunks within `most`
    assert grown_backward_bytes([10, 10], 20, 5.0, 10.0, 10) == 20
    assert grown_backward_bytes([10, 10], 0, 50.0, 10.0, 100) == 20
