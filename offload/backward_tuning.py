"""The default's backward loads, grown to what the next forward stalls for.

With forward overlap and `load_in_backward` left unset (no "auto"), the backward loads
the chunks the next forward waits for first, and more within the room under the measured
peak (`BackwardLoads(first_wait=...)`): no memory beyond what the run has used anyway.
Where the forward is short beside the state it loads (a small micro-batch), it still
stalls for the loads: the host link carries only what fits in the forward's time. Each ms
of that stall is a ms of loads the backward can carry instead, at the cost of holding them
from the backward on. So `TIMED_STEPS` steps are timed (`StepTimer`: the trainer's stalls,
the loads' rate, the backward's length), and the backward then loads the leading chunks
that the stall's ms carry at that rate besides what it loads already
(`grown_backward_bytes`), within what the backward's length carries and the device's
headroom (free at the peak). The next timed steps check it: a round that took back at
least half the stall it moved, less what it lengthened the backward by, is kept and grows
again while a stall is left, `TUNING_ROUNDS` rounds at most. One that did not, but whose
median step got faster by `FASTER_ENOUGH` (the loads also spared the forward what its
waits do not show: the trainer's copies queued behind them), is checked against the bytes
before it for a round (a run's early steps may just be getting faster): kept where those
are slower by as much, else it stays with them. Any other round goes back to the bytes
before it (the stall was not the link's but an update's own time, or the loads took as
long in the backward as the forward waited less). A stall under `STALL_FLOOR_FRACTION` of the
step, or under `STALL_TOLERANCE_MS`, is left. On a device that times no events (the CPU)
nothing grows.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from offload.residency import BACKWARD_LOAD_SHARE, STALL_TOLERANCE_MS, StepTimer

TIMED_STEPS = 4
"""Steps timed per round, after the first plan's step and after each re-plan's step (whose
forward loads what the backward before it loaded for the plan before). The round's step is
the median of all but the last (waiting for its end would drain the device): three, so a
one-off in one of them does not decide the round."""
TUNING_ROUNDS = 2
STALL_FLOOR_FRACTION = 0.02
"""A stall under this share of the step is not worth holding state from the backward on."""
TOOK_BACK_ENOUGH = 0.5
"""A round that took back less than this share of the stall it moved is undone, unless its
step got faster by `FASTER_ENOUGH`."""
FASTER_ENOUGH = 0.02
"""A round whose median step got faster by this share of the step before it, though it took
back too little of the stall, is checked against the bytes before it, and kept where those
are slower by as much: the step is what the trainer waits for."""
TUNING_STEPS_AT_MOST = 1 + (TUNING_ROUNDS + 2) * (TIMED_STEPS + 1)
"""Steps until the tuning is done, at most: the first plan's, then per round its timed ones
and the one it decides (and re-plans) at; the rounds: `TUNING_ROUNDS` that grow, the one
that checks the last, and one that checks it against the bytes before it."""


Agree = Callable[[Sequence[float], Sequence[float]], tuple[list[float], list[float]]]
"""`agree(largest, least)`: each of `largest` at its largest and each of `least` at its
least over the ranks (one collective)."""

HELD_BACK = ("the backward's length", "the device's headroom", "gpu_budget_bytes")
"""What may stop a round short of the bytes its stall carries, in the order it is found."""


@dataclass(frozen=True)
class TuningRound:
    """One round's measurement (the slowest rank's stall, the least rate and backward)
    and what the backward loads after it (`loaded_bytes`: before it); `held_back_by`: of
    `HELD_BACK`, what kept a growing round from all the stall carries (on any rank), or
    None."""

    stall_ms: float
    iteration_ms: float
    load_bytes_per_ms: float
    backward_ms: float
    loaded_bytes: int
    chosen_bytes: int
    held_back_by: str | None = None


def grown_backward_bytes(
    chunk_bytes: Sequence[int], loaded: int, stall_ms: float, bytes_per_ms: float, most: int
) -> int:
    """The bytes of leading chunks the backward loads once it also carries what the forward
    stalled `stall_ms` for: `loaded` (a prefix it loads now) and `stall_ms` of loads at
    `bytes_per_ms`, rounded up to whole chunks, but no more than the whole chunks within
    `most`, and never less than `loaded`.

    >>> grown_backward_bytes([10, 10, 10, 10], 10, 1.5, 10.0, 40)
    30
    >>> grown_backward_bytes([10, 10, 10, 10], 10, 1.5, 10.0, 25)
    20
    """
    ends = list(itertools.accumulate(chunk_bytes))
    wanted = loaded + stall_ms * bytes_per_ms
    up = next((end for end in ends if end >= wanted), ends[-1] if ends else 0)
    down = max((end for end in ends if end <= most), default=0)
    return max(loaded, min(up, down))


class BackwardTuning:
    """The default's backward loads, from the first plan until it has settled (`rounds`).

    `new_timer()`: a fresh `StepTimer` per round (each round's profiles are its own)."""

    def __init__(self, new_timer: Callable[[], StepTimer]) -> None:
        self.new_timer = new_timer
        self.timer = new_timer()
        self.rounds: list[TuningRound] = []
        self._steps = 0  # steps started since the round's first
        # a round kept for its faster step alone, while the bytes before it run again
        self._checking: TuningRound | None = None

    @property
    def profiling(self) -> bool:
        """This step's chunks, loads, the next forward's waits and the backward after it
        are timed."""
        return 1 <= self._steps <= TIMED_STEPS

    @property
    def deciding(self) -> bool:
        """This step decides (`decide`): the round's timed steps are done, or nothing is
        timed (the CPU: done at once)."""
        return self._steps > TIMED_STEPS or not self.timer.timed

    def step_started(self, stream: object) -> None:
        """A step starts on the trainer's stream (every step after the first plan's)."""
        self._steps += 1
        self.timer.iteration_started(stream)

    def decide(
        self,
        chunk_bytes: Sequence[int],
        loaded: int,
        limit: Callable[[int], str | None],
        agree: Agree,
    ) -> tuple[int | None, bool]:
        """At the step just started: the backward's bytes from here (None: keep what runs),
        and whether the tuning is done. `chunk_bytes`: the running plan's chunks
        (rank-invariant, in step order); `loaded`: the leading bytes its backward loads;
        `limit(bytes)`: what keeps that plan off this rank's device (of `HELD_BACK`: the
        headroom beside the run's peak, the user's budget), None where it fits;
        `agree(largest, least)`: those across the ranks (one collective).

        An error here (reading the times, planning) ends the tuning on every rank at this
        step, each rank joining the collectives its peers make: raised where it happened,
        and a RuntimeError on its peers, so no rank steps alone."""
        if not self.deciding:
            return None, False
        if not self.timer.timed:
            return None, True
        error: Exception | None = None
        try:
            measured = self._measured()
        except Exception as err:
            error, measured = err, (0.0, 0.0, 0.0, 0.0)
        stall, iteration, rate, backward = measured
        (stall, iteration, failed), (rate, backward) = agree(
            [stall, iteration, float(error is not None)], [rate, backward]
        )
        if failed:
            self._failed(error)
        checked, self._checking = self._checking, None
        if checked is not None:  # the bytes before it ran again: kept where they were slower
            slower = iteration - checked.iteration_ms >= FASTER_ENOUGH * iteration
            back, held_back = (
                self._fitting([checked.loaded_bytes], loaded, limit, agree)
                if slower
                else (loaded, 0)
            )
            reason = HELD_BACK[held_back - 1] if held_back and back == loaded else None
            self._record(stall, iteration, rate, backward, loaded, back, reason)
            return (back if back > loaded else None), True
        last = self.rounds[-1] if self.rounds else None
        if last is not None and last.chosen_bytes > last.loaded_bytes:
            moved_ms = (last.chosen_bytes - last.loaded_bytes) / max(last.load_bytes_per_ms, 1e-9)
            # the forward's stall it took back, less what it added to the backward
            took_back = last.stall_ms - stall - max(0.0, backward - last.backward_ms)
            if took_back < TOOK_BACK_ENOUGH * min(moved_ms, last.stall_ms):
                self._record(stall, iteration, rate, backward, loaded, last.loaded_bytes)
                if 0 < iteration <= (1 - FASTER_ENOUGH) * last.iteration_ms:
                    self._checking = self.rounds[-1]
                    self._next_round()
                    return last.loaded_bytes, False
                return last.loaded_bytes, True
        if (
            len(self.rounds) >= TUNING_ROUNDS
            or stall <= max(STALL_TOLERANCE_MS, STALL_FLOOR_FRACTION * iteration)
            or rate <= 0
        ):
            self._record(stall, iteration, rate, backward, loaded, loaded)
            return None, True
        carried = int(BACKWARD_LOAD_SHARE * backward * rate)
        everything = sum(chunk_bytes)
        wanted = grown_backward_bytes(chunk_bytes, loaded, stall, rate, everything)
        chosen = grown_backward_bytes(chunk_bytes, loaded, stall, rate, max(carried, loaded))
        held_back = 1 if chosen < wanted else 0  # the backward's length
        ends = [end for end in itertools.accumulate(chunk_bytes) if loaded < end <= chosen]
        chosen, held_back = self._fitting(ends, loaded, limit, agree, held_back)
        reason = HELD_BACK[held_back - 1] if held_back and chosen < wanted else None
        self._record(stall, iteration, rate, backward, loaded, chosen, reason)
        if chosen <= loaded:
            return None, True
        self._next_round()
        return chosen, False

    def _fitting(
        self,
        ends: Sequence[int],
        loaded: int,
        limit: Callable[[int], str | None],
        agree: Agree,
        held_back: int = 0,
    ) -> tuple[int, int]:
        """The largest of `ends` (ascending, each a plan's bytes) that fits on every rank
        (each holds its own shards), else `loaded`; and what kept the next one larger off,
        as a 1-based index into `HELD_BACK` (`held_back`, where nothing is found, the
        caller's), agreed with the rank the bytes came from (one collective). An error on
        any rank raises on every rank."""
        fitting, error = loaded, None
        try:
            for end in reversed(ends):
                reason = limit(end)
                if reason is None:
                    fitting = end
                    break
                held_back = 1 + HELD_BACK.index(reason)
        except Exception as err:
            error, fitting, held_back = err, -1, 0
        # The least over the ranks, with the reason of the rank it came from: one value,
        # the bytes times the codes' count less the code (float64 holds it exactly).
        codes = len(HELD_BACK) + 1
        _, (agreed,) = agree([], [float(fitting * codes + len(HELD_BACK) - held_back)])
        fitting, held_back = divmod(int(agreed), codes)
        if fitting < 0:
            self._failed(error)
        return fitting, len(HELD_BACK) - held_back

    def _measured(self) -> tuple[float, float, float, float]:
        """This rank's round: the median stall and iteration, the load rate, the backward."""
        timer = self.timer
        profiles = timer.profiles()
        stall = statistics.median(p.stall_ms for p in profiles) if profiles else 0.0
        # each to the next step's start, but this one's (queued behind the backward: waiting
        # for it drains the device while the host plans)
        iterations = timer.iterations_ms(0, TIMED_STEPS - 1)
        iteration = statistics.median(iterations) if iterations else 0.0
        return stall, iteration, timer.load_bytes_per_ms(), timer.backward_ms()

    @staticmethod
    def _failed(error: Exception | None) -> NoReturn:
        """Raised on every rank (no rank steps alone): the error where it happened."""
        if error is not None:
            raise error
        raise RuntimeError(
            "load_in_backward's default tuning failed on another rank (see its error), so "
            "no rank ran this step; every rank steps with the loads it had from the next step"
        )

    def _record(
        self,
        stall: float,
        iteration: float,
        rate: float,
        backward: float,
        loaded: int,
        chosen: int,
        held_back_by: str | None = None,
    ) -> None:
        self.rounds.append(
            TuningRound(stall, iteration, rate, backward, loaded, chosen, held_back_by)
        )

    def _next_round(self) -> None:
        """The re-plan's step is not timed (its forward loads what the backward before it
        loaded for the old plan); the `TIMED_STEPS` after it are."""
        self.timer = self.new_timer()
        self._steps = 0
