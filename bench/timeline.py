"""Where one offloaded step's time goes, chunk by chunk: marks on the copy pipeline's lanes.

`StepTimeline(optimizer)` wraps the `offload.streams.CopyStreams` instance the
optimizer drives (found among its attributes, so no offload code changes for a
picture): every `wait(stream, event)` opens a box on that stream's lane (the work
enqueued after it starts once the wait is over) and the next `record(event,
stream)` on the lane closes it. On the GPU the marks are timing events recorded
on the streams, read after the step; on the CPU, where the pipeline runs in
program order and every stream is None, they are wall-clock times and the lane
is taken from the call order (a wait in the H2D loader, else update and D2H in
turn).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from offload.streams import CopyStreams

LANES = ("H2D", "update", "D2H")


def find_copy_streams(obj: Any, depth: int = 2) -> CopyStreams:
    """The CopyStreams instance among `obj`'s attributes (or theirs, `depth` levels down)."""
    for value in vars(obj).values():
        if isinstance(value, CopyStreams):
            return value
    if depth > 0:
        for value in vars(obj).values():
            if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor | type):
                try:
                    return find_copy_streams(value, depth - 1)
                except LookupError:
                    pass
    raise LookupError(f"no CopyStreams in {type(obj).__name__}")


class StepTimeline:
    """Boxes per lane, in seconds from entering the context, of the work enqueued inside it."""

    def __init__(self, optimizer: Any) -> None:
        self.streams = find_copy_streams(optimizer)
        self.gpu = self.streams.async_copies
        self._marks: list[tuple[str, str, Any]] = []  # (lane, "open"|"close", event or seconds)
        self._cpu_next = "update"

    def _now(self, stream) -> Any:
        if not self.gpu:
            return time.perf_counter()
        event = torch.Event(device=self.streams.device, enable_timing=True)
        event.record(stream)
        return event

    def _lane(self, stream) -> str:
        if stream is not None:
            if stream == self.streams.h2d:
                return "H2D"
            return "D2H" if stream == self.streams.d2h else "update"
        return "CPU"  # resolved in _cpu_lane

    def _cpu_lane(self) -> str:
        if sys._getframe(2).f_code.co_name == "_load":  # the caller of wait() loads a chunk
            return "H2D"
        lane, self._cpu_next = self._cpu_next, "D2H" if self._cpu_next == "update" else "update"
        return lane

    def __enter__(self) -> StepTimeline:
        streams, wait, record = self.streams, self.streams.wait, self.streams.record
        self._start = self._now(streams.current())
        self._open_lane: str | None = None

        def timed_wait(stream, event) -> None:
            wait(stream, event)
            lane = self._lane(stream)
            if lane == "CPU":
                lane = self._cpu_lane()
                self._open_lane = lane
            self._marks.append((lane, "open", self._now(stream)))

        def timed_record(event, stream) -> None:
            record(event, stream)
            lane = self._lane(stream)
            if lane == "CPU":
                lane = self._open_lane
            if lane is not None:
                self._marks.append((lane, "close", self._now(stream)))

        streams.wait, streams.record = timed_wait, timed_record  # instance attributes
        return self

    def __exit__(self, *exc: object) -> None:
        del self.streams.wait, self.streams.record  # back to the class's methods
        if self.gpu:
            torch.accelerator.synchronize(self.streams.device)

    def lanes(self) -> dict[str, list[tuple[float, float]]]:
        """(start, end) seconds since the step began, per lane: each open to its next close."""

        def seconds(mark: Any) -> float:
            if self.gpu:
                return self._start.elapsed_time(mark) / 1e3
            return mark - self._start

        boxes: dict[str, list[tuple[float, float]]] = {lane: [] for lane in LANES}
        open_at: dict[str, float] = {}
        for lane, kind, mark in self._marks:
            if kind == "open":
                open_at[lane] = seconds(mark)
            elif lane in open_at:
                boxes[lane].append((open_at.pop(lane), seconds(mark)))
        return boxes
