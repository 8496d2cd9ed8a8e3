"""`gpu_resident_bytes="auto"`'s choice from measured stalls: pure, no processes."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from offload.auto_residency import AutoResidency, StepShape
from offload.chunk_plan import ParamSpec, StateSpec, plan_offload, unit_sizes
from offload.residency import (
    AUTO_MEASURED_STEPS,
    AUTO_STEPS_AT_MOST,
    FINE_TOTALS,
    MAX_PROBES,
    NEAR_FASTEST,
    NOISE_CAP,
    SEARCH_STEPS,
    ChunkWait,
    Probe,
    Split,
    StepProfile,
    StepTimer,
    choose_residency,
    largest_fitting_total,
    leading_units,
    median_error_ms,
    near_fastest,
    next_split,
    predicted_stall_ms,
    search_splits,
    settled_split,
    split_total,
    whole_state_split,
    with_split,
)

# Four chunks of 100 bytes done 10, 20, 30, 40 ms into the step. The forward reaches the
# root module at 5 ms, which needs the first 200 bytes (chunk 1): it stalls 15 ms; a layer
# needing chunk 2 finds it done; the forward's end waits 5 ms for chunk 3.
CHUNKS = [100, 100, 100, 100]
ENDS = [100, 200, 300, 400]
PROFILE = StepProfile(
    (10.0, 20.0, 30.0, 40.0),
    (ChunkWait(1, 200, 15.0), ChunkWait(2, 300, 0.0), ChunkWait(3, 400, 5.0)),
)


def test_predicted_stall_of_a_resident_prefix():
    # the trainer is 20 ms late at the end (15 + 5); the first R bytes resident make
    # every later chunk done as much earlier as the step took to do them
    assert predicted_stall_ms(PROFILE, ENDS, 0) == 20.0
    assert predicted_stall_ms(PROFILE, ENDS, 50) == pytest.approx(15.0)  # half of chunk 0
    assert predicted_stall_ms(PROFILE, ENDS, 100) == 10.0  # root: 5 left, end: 10 left
    # the root needs only resident state; the end is still 20 - 20 = 0 late
    assert predicted_stall_ms(PROFILE, ENDS, 200) == 0.0
    hidden = StepProfile(
        PROFILE.chunk_done_ms, tuple(ChunkWait(w.chunk, w.needs, 0.0) for w in PROFILE.waits)
    )
    assert predicted_stall_ms(hidden, ENDS, 0) == 0.0


@pytest.mark.parametrize(
    ("units", "cap", "chosen", "kept"),
    [
        ([100, 100, 100, 100], 400, 200, 2),  # the fewest leading units that hide it all
        ([100, 100, 100, 100], 150, 100, 1),  # the cap allows one: 10 ms stay exposed
        ([100, 100, 100, 100], 99, 0, 0),  # no unit fits the cap
        ([250, 150], 400, 250, 1),  # a unit past the root's need: kept whole
        ([0, 100, 0, 100, 200], 400, 200, 4),  # stateless units cost nothing
    ],
)
def test_choose_residency_keeps_the_fewest_leading_units_that_remove_the_stall(
    units, cap, chosen, kept
):
    choice = choose_residency([PROFILE], CHUNKS, units, cap)
    assert (choice.resident_bytes, choice.resident_units) == (chosen, kept)
    assert choice.cap_bytes == cap and choice.state_bytes == sum(units)
    assert choice.measured_stall_ms == 20.0
    assert choice.predicted_stall_ms == predicted_stall_ms(PROFILE, ENDS, chosen)


def test_stall_within_the_tolerance_of_the_best_is_not_worth_more_memory():
    # chunk 3 took 0.5 ms: keeping it too would save only that
    profile = StepProfile((10.0, 20.0, 30.0, 30.5), (ChunkWait(3, 400, 30.5),))
    choice = choose_residency([profile], CHUNKS, [100] * 4, 400)
    assert choice.resident_bytes == 300 and choice.predicted_stall_ms == 0.5


def test_choice_takes_the_median_over_steps_and_nothing_when_nothing_stalls():
    quiet = StepProfile(PROFILE.chunk_done_ms, (ChunkWait(3, 400, 0.0),))
    assert choose_residency([quiet] * 3, CHUNKS, [100] * 4, 400).resident_bytes == 0
    # one noisy step of three does not move it
    assert choose_residency([quiet, PROFILE, quiet], CHUNKS, [100] * 4, 400).resident_bytes == 0
    assert choose_residency([PROFILE, PROFILE, quiet], CHUNKS, [100] * 4, 400).resident_bytes == 200
    assert choose_residency([], CHUNKS, [100] * 4, 400).resident_bytes == 0


def test_a_step_without_overlap_is_one_stall_shortened_from_its_end():
    # chunks took 10, 10, 10, 1 ms; on the trainer's stream all 31 ms are exposed
    profile = StepProfile((10.0, 20.0, 30.0, 31.0), (ChunkWait(3, 400, 31.0),))
    end = profile.from_the_end()
    assert end.chunk_done_ms == (1.0, 11.0, 21.0, 31.0)
    assert end.waits == (ChunkWait(3, 400, 31.0),)
    # keeping the last unit saves only 1 ms: the cap's worth is taken
    assert choose_residency([end], CHUNKS[::-1], [100] * 4, 300).resident_bytes == 300


def test_the_plan_keeps_exactly_the_chosen_leading_units_on_every_rank():
    """The choice is a prefix sum of rank-invariant unit sizes: each rank's plan keeps the
    same units, and the largest of the ranks' choices (what they agree on) is one too."""
    rng = random.Random(0)
    specs = [
        ParamSpec(n, (StateSpec("exp_avg", torch.Size([n]), torch.float32),), splittable=True)
        for n in (64 * rng.randint(1, 9) for _ in range(12))
    ]
    units = [(i,) for i in range(12)]
    sizes = [u.bytes for u in unit_sizes(units, specs)]
    plan = plan_offload(units, specs, 600)
    chunk_bytes = [c.invariant_bytes for c in plan.chunks]
    assert sum(chunk_bytes) == sum(sizes)
    done = tuple(float(sum(chunk_bytes[: c + 1])) / 10 for c in range(len(chunk_bytes)))
    choices = []
    for rank_stall in (100.0, 300.0, 600.0):  # each rank measured its own stall
        profile = StepProfile(done, (ChunkWait(len(done) - 1, sum(sizes), rank_stall),))
        choices.append(choose_residency([profile], chunk_bytes, sizes, sum(sizes) // 2))
    assert len({c.resident_bytes for c in choices}) == 3  # the ranks disagree
    agreed = max(c.resident_bytes for c in choices)
    for _ in choices:
        kept = plan_offload(units, specs, 600, resident_bytes=agreed, resident_first=True)
        touched = {
            flag: {i for c in kept.chunks if c.resident == flag for i in c.params}
            | {s.param for c in kept.chunks if c.resident == flag for s in c.slices}
            for flag in (False, True)
        }
        assert sorted(touched[True]) == list(range(leading_units(sizes, agreed)))
        assert not touched[True] & touched[False]


class _FakeEvent:
    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        pass


def test_a_steps_first_wait_counts_from_the_steps_start():
    """The trainer may reach the forward's first wait after its chunk is done, held back
    by the step itself: that time is exposed, though the wait itself takes none."""
    from offload.residency import StepTimer

    timer = StepTimer(torch.device("cpu"))
    timer._timed = True
    clock = iter([0.0, 26.0, 49.0, 49.01, 60.0, 65.0])
    timer.mark = lambda stream: _FakeEvent(next(clock))
    timer.step_started(None)  # t = 0
    timer.chunk_done(None)  # chunk 0 done at 26 ms
    timer.waited(0, 100, timer.mark(None), timer.mark(None))  # reached at 49: no wait
    timer.waited(0, 100, timer.mark(None), timer.mark(None))  # waited 60 -> 65
    (profile,) = timer.profiles()
    assert [w.stall_ms for w in profile.waits] == [pytest.approx(49.01), 5.0]


def test_a_total_is_loaded_in_the_backward_as_far_as_it_carries_the_rest_resident():
    units = [100, 300, 50, 50]
    assert split_total(0, units, 200) == Split(0, 0)
    assert split_total(150, units, 200) == Split(0, 150)  # all of it in the backward
    assert split_total(350, units, 200) == Split(100, 200)  # 150 left: one unit fits
    assert split_total(420, units, 0) == Split(400, 0)  # nothing in the backward
    assert split_total(500, units, 100) == Split(400, 100)
    assert split_total(500, units, 100).total == 500


def test_a_total_kept_resident_first_loads_the_first_bytes_in_the_backward():
    units = [100, 300, 50, 50]
    # resident first behind 50 bytes of loads: the units that fit, the rest up to the cap
    assert split_total(350, [100] * 4, 200, backward_first=50) == Split(300, 50)
    assert split_total(350, [100] * 4, 200) == Split(100, 200)  # loads first
    assert split_total(40, units, 200, backward_first=50) == Split(0, 40)
    assert split_total(420, units, 200, backward_first=50) == Split(100, 200)  # 320 left
    # the whole state's split (500 bytes) leaves a gap: from its total (300) on, as it
    assert split_total(460, units, 200, backward_first=50) == Split(100, 200)
    more = [*units, 400]  # the whole state's split keeps 700 of 900
    assert split_total(460, more, 200, backward_first=50) == Split(400, 60)
    assert split_total(460, more, 200, backward_first=300) == Split(100, 200)  # its cap
    # the whole state loads first either way
    assert split_total(500, units, 100, backward_first=50) == split_total(500, units, 100)
    # The whole state's split leaves a gap (1550 of 1600 bytes): its total, the limit the
    # search is given where it fits, splits as it does, not resident first.
    gapped = split_total(1600, [100] * 16, 250)
    assert gapped == Split(1300, 250)
    for total in (1550, 1560, 1600):
        assert split_total(total, [100] * 16, 250, backward_first=50) == gapped
    assert split_total(1540, [100] * 16, 250, backward_first=50) == Split(1400, 140)
    assert search_splits([100] * 16, 250, limit=1550, backward_first=50) == [
        Split(100, 100),
        Split(300, 100),
        Split(500, 100),
        Split(700, 100),
        Split(900, 100),
        Split(1100, 100),
        Split(1300, 100),
        gapped,
    ]
    # every split gives itself back from its own total, and totals grow with the total
    units = [100, 300, 50, 50, 700, 20]
    for first in (None, 0, 30, 120, 400):
        splits = [split_total(t, units, 250, first) for t in range(sum(units) + 1)]
        assert all(split_total(s.total, units, 250, first) == s for s in splits)
        assert all(a.total <= b.total for a, b in itertools.pairwise(splits))


def test_the_whole_states_split_keeps_resident_what_the_backward_cannot_load():
    units = [100] * 16  # 1600 bytes
    # the backward's 250 and 13 units leave 50 bytes to the forward: 14 units resident
    assert split_total(1600, units, 250) == Split(1300, 250)
    assert whole_state_split(units, 250) == Split(1400, 200)
    assert whole_state_split(units, 300) is None  # no gap
    assert whole_state_split(units, 0) is None  # nothing loads in the backward: all resident
    # a large first unit: resident whole, the backward loads the rest
    assert split_total(1000, [600, 100, 100, 100, 100], 350) == Split(600, 350)
    assert whole_state_split([600, 100, 100, 100, 100], 350) == Split(700, 300)


def test_the_search_tries_eighths_of_the_state_up_to_the_limit():
    units = [100] * 16  # 1600 bytes: steps of 200
    splits = search_splits(units, 200, limit=1000)
    assert [s.total for s in splits] == [200, 400, 600, 800, 1000]
    assert splits[0] == Split(0, 200) and splits[2] == Split(400, 200)
    assert [s.total for s in search_splits(units, 250, limit=1100)] == [
        200,
        350,
        550,
        750,
        950,
        1050,  # the backward's 250, then whole units of 100
    ]
    assert search_splits(units, 0, limit=0) == []
    # totals that split alike are tried once
    assert [s.total for s in search_splits([800, 800], 0, limit=1600)] == [800, 1600]


def _probes(*pairs):
    return [Probe(Split(0, total), ms) for total, ms in pairs]


SPLITS = [Split(0, t) for t in (100, 200, 300, 400, 500, 600, 700, 800)]


def _search(step_ms):
    """Run the search against a step time per total; the probes it made."""
    probes = _probes((0, step_ms(0)))
    while (split := next_split(probes, SPLITS)) is not None:
        probes.append(Probe(split, step_ms(split.total)))
    return probes


def test_the_search_runs_the_most_first_then_walks_down_for_the_least_near_the_fastest():
    # 100 ms with nothing kept, 1 ms less per 10 bytes down to 60 ms at 400
    probes = _search(lambda total: max(60.0, 100.0 - total / 10))
    # below the least near, twice as far each time: 1, 2, then 4 splits below the largest
    # (the bisection's midpoint, 200, is no further down than that)
    assert [p.split.total for p in probes] == [0, 800, 700, 500, 200]
    assert len(probes) == 1 + MAX_PROBES
    assert settled_split(probes) == Split(0, 500)  # the least tried near the fastest

    # keeping state off the forward's path gains nothing: back to nothing kept
    flat = _search(lambda total: 100.0 + total / 1000)
    assert [p.split.total for p in flat] == [0, 800]
    assert settled_split(flat) == Split(0, 0)

    # all of it is needed: one split below the largest is not near, and the search stops
    steep = _search(lambda total: 100.0 - total / 10)
    assert [p.split.total for p in steep] == [0, 800, 700]
    assert settled_split(steep) == Split(0, 800)

    assert next_split(_probes((0, 100.0)), []) is None  # the budget keeps nothing


def test_the_search_pays_little_for_a_step_that_needs_the_whole_state():
    """Probes measured at batch 4 on an H100 (`train_step_hf_b4_auto_reference_h100`):
    only the whole state kept off the forward's path was fast. Bisecting from it tried
    the default's 1 GiB and then 3.1 and 3.6 GiB, 1.27-1.64x slower than the fastest,
    six steps each; walking down tries one split below the largest and stops."""
    gib = 2**30
    measured = [(0.0, 312.3), (1.0, 286.5), (3.09, 231.1), (3.58, 221.4), (6.35, 174.2)]

    def step_ms(total):  # between the measured totals, on the line through them
        for (t0, ms0), (t1, ms1) in zip(measured, measured[1:], strict=False):
            if total <= t1 * gib:
                return ms0 + (ms1 - ms0) * (total / gib - t0) / (t1 - t0)
        return measured[-1][1]

    splits = [Split(0, round(i * 6.35 * gib / 8)) for i in range(1, 9)]
    default = Split(0, gib)
    splits = with_split(splits, default)
    probes = _probes((0, step_ms(0)))
    while (split := next_split(probes, splits, default)) is not None:
        probes.append(Probe(split, step_ms(split.total)))
    assert [p.split for p in probes] == [Split(0, 0), splits[-1], splits[-2]]
    assert settled_split(probes) == splits[-1]
    assert probes[2].iteration_ms < 1.1 * probes[1].iteration_ms  # the one slower probe


def test_the_search_stops_at_a_split_near_the_fastest_that_costs_no_memory():
    probes = _probes((0, 100.0), (800, 60.0))
    assert next_split(probes, SPLITS) == Split(0, 700)
    # held in the room under the peak: settled on, whatever less would measure
    assert next_split(probes, SPLITS, free={Split(0, 800)}) is None
    # one that is not near the fastest does not stop it
    assert next_split(probes, SPLITS, free={Split(0, 0)}) == Split(0, 700)


def test_the_search_tries_the_default_where_the_largest_is_no_faster_than_nothing():
    default = Split(0, 250)
    splits = with_split(SPLITS, default)
    assert [s.total for s in splits] == [100, 200, 250, 300, 400, 500, 600, 700, 800]
    assert with_split(SPLITS, Split(0, 300)) == SPLITS  # one split a total
    # only the default is fast: the ends alike, as with the whole state loaded in the backward
    probes = _probes((0, 100.0))
    while (split := next_split(probes, splits, default)) is not None:
        probes.append(Probe(split, 60.0 if split == default else 100.0))
    assert [p.split.total for p in probes][:3] == [0, 800, 250]
    assert settled_split(probes) == default
    # a default the budget left out of the splits is not tried
    assert next_split(_probes((0, 100.0), (800, 100.0)), SPLITS, default) is None
    # where the largest is faster than nothing, the walk goes on from it instead
    assert next_split(_probes((0, 100.0), (800, 60.0)), splits, default) == Split(0, 700)


def test_near_the_fastest_a_split_held_in_the_room_under_the_peak_settles_by_its_step():
    # the whole state loaded in the backward is fastest; 100 bytes, 0.5% slower, is near
    probes = _probes((0, 100.0), (800, 60.0), (400, 61.0), (100, 60.3))
    assert settled_split(probes) == Split(0, 100)  # the least total near the fastest
    # held within the room under the peak, each costs no memory: the fastest of them
    assert settled_split(probes, {Split(0, 100), Split(0, 800)}) == Split(0, 800)
    # only splits near the fastest count
    assert settled_split(probes, {Split(0, 400)}) == Split(0, 100)


def test_a_medians_error_is_robust_to_one_slow_step():
    assert median_error_ms([]) == median_error_ms([100.0]) == 0.0
    assert median_error_ms([100.0] * 5) == 0.0
    # deviations from the median 100: 0, 2, 2, 4, 60 -> MAD 2, sigma 2.9652, / sqrt(5)
    error = median_error_ms([100.0, 98.0, 102.0, 104.0, 160.0])
    assert error == pytest.approx(1.4826 * 2 * (3.141592653589793 / 2 / 5) ** 0.5)


def test_what_the_steps_spread_cannot_tell_apart_settles_on_the_least():
    """Steps of one run vary by 5-15% on the H200: a split 4% slower than the fastest, with
    medians that uncertain, is as fast; one slower by more than the noise is not."""
    noisy = [
        Probe(Split(0, 0), 250.0, error_ms=6.0),
        Probe(Split(0, 800), 166.0, error_ms=5.0),
        Probe(Split(0, 400), 172.7, error_ms=4.0),  # 6.7 ms slower: within 2 x 6.4
        Probe(Split(0, 200), 194.0, error_ms=4.0),  # 28 ms slower: not
    ]
    assert settled_split(noisy) == Split(0, 400)
    assert next_split(noisy, SPLITS) == Split(0, 300)  # bisects between 200 and 400
    # the same medians measured without spread: only the fastest is near it
    exact = [Probe(p.split, p.iteration_ms) for p in noisy]
    assert settled_split(exact) == Split(0, 800)


def test_steps_that_drift_within_a_probe_never_make_a_much_slower_split_as_fast():
    """Probes measured on the H200 (batch-4 Llama): nothing kept, then the most the budget
    keeps, whose steps drifted from 199 to 268 ms. The drift's error (24 ms) covered the
    47 ms gap, and the search settled on keeping nothing, its slowest split. A split
    more than NOISE_CAP slower than the fastest is never as fast; the search goes on."""
    steps_nothing = (260.48, 274.91, 276.88)
    steps_most = (209.77, 199.15, 227.74, 257.31, 268.42)
    probes = [
        Probe(Split(0, 0), 274.91, steps_nothing, median_error_ms(steps_nothing)),
        Probe(Split(0, 800), 227.74, steps_most, median_error_ms(steps_most)),
    ]
    assert probes[1].error_ms > 20.0
    assert 2 * math.hypot(probes[0].error_ms, probes[1].error_ms) > 274.91 - 227.74
    assert not near_fastest(probes[0], probes)
    assert next_split(probes, SPLITS) == Split(0, 700)
    assert settled_split(probes) == Split(0, 800)
    # within the cap, the noise still decides (the first test of this kind)
    close = [Probe(Split(0, 0), 1.04 * 227.74, (), 10.0), probes[1]]
    assert near_fastest(close[0], close) and 1.04 < 1 + NOISE_CAP


def test_the_search_stops_after_max_probes_and_settles_on_what_it_measured():
    many = [Split(0, t) for t in range(10, 330, 10)]  # 32 splits: the walk needs 6
    probes = _probes((0, 100.0))
    while (split := next_split(probes, many)) is not None:
        probes.append(Probe(split, max(80.0, 100.0 - split.total / 10)))
    assert len(probes) == 1 + MAX_PROBES
    fastest = min(p.iteration_ms for p in probes)
    assert (
        settled_split(probes)
        == min(
            (p for p in probes if p.iteration_ms <= (1 + NEAR_FASTEST) * fastest),
            key=lambda p: p.split.total,
        ).split
    )


def test_plans_with_room_for_all_share_one_host_layout_whatever_stays_resident():
    specs = [
        ParamSpec(n, (StateSpec("exp_avg", torch.Size([n]), torch.float32),), splittable=True)
        for n in (64, 200, 130, 96, 300)
    ]
    units = [(i,) for i in range(len(specs))]
    plans = [
        plan_offload(
            units,
            specs,
            500,
            resident_bytes=r,
            resident_first=True,
            ramp_first=ramp,
            host_room_for_all=True,
        )
        for r in (0, 256, 1300, 10_000)
        for ramp in (True, False)
    ]
    homes = [
        {(v.param, v.spec.key): v.home_offset for c in p.chunks if not c.resident for v in c.views}
        for p in plans
    ]
    for plan, home in zip(plans, homes, strict=True):
        assert plan.host_numel == plans[0].host_numel
        assert all(homes[0][k] == offset for k, offset in home.items())
    assert plans[-1].resident_bytes > 0 and not homes[-1]  # all resident, host room kept
    tight = plan_offload(units, specs, 500, resident_bytes=1300, resident_first=True)
    assert sum(tight.host_numel.values()) < sum(plans[0].host_numel.values())


def test_the_largest_fitting_total_is_scanned_down_not_bisected():
    units = [100, 300, 50, 50]
    # of what a bisection would try only 100 fits: found by scanning down
    assert largest_fitting_total(units, 0, lambda split: split.total == 100) == 100
    assert largest_fitting_total(units, 0, lambda split: split.total != 500) == 450
    assert largest_fitting_total(units, 0, lambda split: False) == 0
    # with the backward's 60: 450 leaves 390 for whole units, 100 of them fit
    assert largest_fitting_total(units, 60, lambda split: split.total < 450) == 160


def test_the_largest_fitting_total_finds_loads_in_the_backward_below_the_first_unit():
    """A first unit (an embedding) larger than the backward's cap: the budget holds the
    backward's slots for 300 bytes of its 600, and no resident state."""
    units = [1000, 100, 100]

    def fits(split):
        return split.backward_load_bytes <= 300 and split.resident_bytes == 0

    assert largest_fitting_total(units, 600, fits) == 300


def test_the_largest_fitting_total_plans_a_bounded_number_of_splits():
    asked = []

    def fits(split):
        asked.append(split)
        return split.total <= 7_777

    units = [10] * 1000  # 10_000 bytes
    assert largest_fitting_total(units, 0, fits) >= 7_777 - 10 * -(-125 // FINE_TOTALS)
    assert len(asked) <= SEARCH_STEPS + 1 + FINE_TOTALS


class _SplitTimer:
    """A timer of a device that times events, whose iterations each take what `step_ms`
    says of the split they ran (the driver records it), and whose measured steps stall as
    `PROFILE` does."""

    timed = True

    def __init__(self, step_ms):
        self.step_ms = step_ms
        self.ran = []  # the split each iteration ran

    def iteration_started(self, stream):
        self.ran.append(None)

    def iterations_ms(self, first, last):
        return [self.step_ms(split) for split in self.ran[first:last]]

    def profiles(self):
        return [PROFILE] * AUTO_MEASURED_STEPS

    def backward_ms(self, since=0):
        return 1000.0

    def load_bytes_per_ms(self):
        return 0.5  # "auto"'s backward carries 0.65 x 500 bytes


def _settle_auto(step_ms, room, default_backward=0, held=None):
    """Run "auto" with forward overlap on eight units (and chunks) of 100 bytes, each
    split holding its total (or `held(split)`), until it settles (within
    `AUTO_STEPS_AT_MOST`); its choice."""
    timer = _SplitTimer(step_ms)
    auto = AutoResidency(timer, None, "auto", torch.device("cpu"))
    shape = StepShape((100,) * 8, (100,) * 8, True)
    running = Split(0, 0)
    for _ in range(AUTO_STEPS_AT_MOST):
        auto.step_started(None)
        running = (
            auto.decide(
                shape, held or _total, lambda: 10**9, lambda: default_backward, lambda: room
            )
            or running
        )
        timer.ran[-1] = running
        if auto.choice is not None:
            return auto.choice
    raise AssertionError(f'"auto" did not settle in {AUTO_STEPS_AT_MOST} steps')


def _total(split):
    return split.total


def test_auto_counts_no_resident_state_as_free_under_the_peak():
    """Resident state is held through the forward, at the peak, however much room the step
    finds under it: of the splits near the fastest, the one that loads nothing and keeps
    nothing, not the fastest that keeps state resident."""

    def step_ms(split):
        # 0.4 % faster with everything kept, a little faster with loads alone
        return 100.0 - split.resident_bytes / 1000 - split.backward_load_bytes / 10_000

    choice = _settle_auto(step_ms, room=10**6)
    assert [p.split for p in choice.probes] == [Split(0, 0), Split(400, 325)]
    assert (choice.resident_bytes, choice.backward_load_bytes) == (0, 0)
    # the default's loads, free and near the fastest too: the fastest of the free
    choice = _settle_auto(step_ms, room=10**6, default_backward=300)
    assert [p.split for p in choice.probes] == [Split(0, 0), Split(400, 325), Split(0, 300)]
    assert (choice.resident_bytes, choice.backward_load_bytes) == (0, 300)


def test_the_whole_states_split_is_tried_where_the_gaps_ring_slot_passes_the_budget():
    """The backward's cap (325 bytes) and whole units leave the forward 75 bytes, whose
    ring slot (100 bytes) takes that split past the default budget (800: the whole state
    resident); the largest that fit kept less. The whole state with one more unit
    resident fits, and is tried first."""

    def held(split):
        return split.total + (100 if split.total < 800 else 0)  # a ring slot where staged

    def step_ms(split):
        return 100.0 - split.total / 20

    choice = _settle_auto(step_ms, room=None, held=held)
    tried = [p.split for p in choice.probes]
    assert tried[:2] == [Split(0, 0), Split(500, 300)]
    assert Split(400, 325) not in tried
    assert (choice.resident_bytes, choice.backward_load_bytes) == (500, 300)
    # where the gap's split fits, it runs as it did, and the whole state's is not tried
    fits = _settle_auto(step_ms, room=None)
    assert [p.split for p in fits.probes][:2] == [Split(0, 0), Split(400, 325)]


def test_the_backwards_length_is_read_without_waiting_for_the_step_now_starting(monkeypatch):
    """ "auto" reads the backward's length as a step starts; that step's start is queued
    behind the backward on the device, and waiting for it drains the device while the host
    re-plans: only backwards that ended at an earlier step's start count."""
    clock = [0.0]

    class Event:  # a timing event on a device, its time set when recorded
        def __init__(self, device=None, enable_timing=False):
            self.at, self.waited = None, False

        def record(self, stream=None):
            self.at = clock[0]

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, end):
            assert end.waited, "an event not waited for has no time yet"
            return end.at - self.at

    monkeypatch.setattr(torch, "Event", Event)
    timer = StepTimer(torch.device("cuda"))
    for start, backward in ((0.0, 7.0), (10.0, 18.0)):  # backwards of 3 and then 2 ms
        clock[0] = start
        timer.iteration_started(None)
        clock[0] = backward
        timer.backward_started(None)
    clock[0] = 20.0
    timer.iteration_started(None)  # the step now starting
    assert timer.backward_ms() == 3.0
    assert not timer._iterations[-1].waited
