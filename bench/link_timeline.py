"""Where the host link idles in an overlapped offloaded step: device events around each
of a `CPUOffloadOptimizer`'s loads (host to GPU) and write-backs (GPU to host), set against
the phase marks of the same steps (`bench.phases`).

The step floor (`bench.train_step --phases`) assumes the link carries the forward's loads
from the forward's start at the both-ways rate. Where a step runs longer, these say which
direction was idle in the forward and when its first load started:
`python -m bench.train_step --phases --link-timeline` adds, per overlapped arm, medians over
the window's steps in ms from the forward's start on the trainer's stream: the forward,
each direction's busy time in the forward and in the backward (the union of its copies),
and when the forward's first load started (negative: in `step()` or the backward before
it) and its last one ended. A copy's time starts once its slot is free (a load's) or its
chunk's update is done (a write-back's) and the stream is done with what came before.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

Event = Any  # a device event: elapsed_time(other) in ms (torch.Event, or a test's stand-in)

FIELDS = (
    "forward_ms",
    "h2d_busy_forward_ms",
    "d2h_busy_forward_ms",
    "first_load_ms",
    "last_load_done_ms",
    "backward_ms",
    "h2d_busy_backward_ms",
    "d2h_busy_backward_ms",
)


def timing_event(device: torch.device) -> Callable[[Any], Event]:
    """A function recording a timing event on a stream (None: the current one)."""

    def record(stream: Any) -> Event:
        event = torch.Event(device=device, enable_timing=True)
        event.record(stream)
        return event

    return record


class LinkTimeline:
    """Times `optimizer`'s copies until `close()`; `summary(marks)` reads them."""

    def __init__(self, optimizer: Any, new_event: Callable[[Any], Event]) -> None:
        self._copies: list[tuple[str, Event, Event]] = []  # ("load" | "write_back", start, end)
        self._executor = executor = optimizer._executor
        streams = executor.streams
        # The bench's one look inside the executor: its two copy methods, wrapped on this
        # instance (close() takes the wrappers off), each copy between two events.
        load, write_back = executor._load, executor._write_back

        def timed_load(chunk: Any, *args: Any, **kwargs: Any) -> bool:
            streams.wait(streams.h2d, streams.freed[chunk.slot])  # as the load will
            start = new_event(streams.h2d)
            loaded = load(chunk, *args, **kwargs)
            if loaded:  # False: no state to copy yet
                self._copies.append(("load", start, new_event(streams.h2d)))
            return loaded

        def timed_write_back(chunk: Any, *args: Any, **kwargs: Any) -> None:
            streams.wait(streams.d2h, streams.stepped[chunk.slot])  # as the write-back will
            start = new_event(streams.d2h)
            write_back(chunk, *args, **kwargs)
            self._copies.append(("write_back", start, new_event(streams.d2h)))

        executor._load, executor._write_back = timed_load, timed_write_back

    def close(self) -> None:
        for name in ("_load", "_write_back"):
            self._executor.__dict__.pop(name, None)

    def summary(self, steps: Sequence[Sequence[Event]]) -> dict[str, float] | None:
        """Medians (`FIELDS`) over `steps` (each step's phase marks, `PhaseMarks.events`:
        its start, first layer, head, forward's end, backward's end, step's end) that have
        a step before them (whose backward's end bounds this forward's loads) and after;
        None with fewer than three steps. Read once the device has passed every event
        (the bench syncs first)."""
        if len(steps) < 3:
            return None
        origin = steps[0][0]
        marks = [[origin.elapsed_time(e) for e in step] for step in steps]
        copies = [
            (kind, origin.elapsed_time(a), origin.elapsed_time(b)) for kind, a, b in self._copies
        ]
        loads = [(a, b) for kind, a, b in copies if kind == "load"]
        backs = [(a, b) for kind, a, b in copies if kind == "write_back"]
        rows = []
        for before, now in zip(marks, marks[1:-1], strict=False):
            start, forward_end, backward_end = now[0], now[3], now[4]
            # the loads this forward waits for: enqueued by `step()` or the forward itself
            mine = [(a, b) for a, b in loads if b > before[4] and a < forward_end]
            rows.append(
                {
                    "forward_ms": forward_end - start,
                    "h2d_busy_forward_ms": busy(loads, start, forward_end),
                    "d2h_busy_forward_ms": busy(backs, start, forward_end),
                    "first_load_ms": min((a for a, _ in mine), default=start) - start,
                    "last_load_done_ms": max((b for _, b in mine), default=start) - start,
                    "backward_ms": backward_end - forward_end,
                    "h2d_busy_backward_ms": busy(loads, forward_end, backward_end),
                    "d2h_busy_backward_ms": busy(backs, forward_end, backward_end),
                }
            )
        return {field: statistics.median(row[field] for row in rows) for field in FIELDS}


def busy(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """How long any of `intervals` covers within [start, end] (their union's length)."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b > max(a, reach):
            total += b - max(a, reach)
            reach = b
    return total
