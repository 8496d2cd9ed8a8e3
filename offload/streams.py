"""Side streams and events for the copy pipeline, device-generic.

On the host (CPU-only torch) there is one synchronous queue: streams and
events become no-ops and the pipeline runs in program order, so CI exercises
the same chunk logic as a GPU run.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator

import torch
from torch import Tensor

PACED_COPIES = 2
"""Copies a paced stream keeps queued ahead of the copy engine. The engine runs copies
in the order they were enqueued, whichever stream they came from, so a copy the trainer
enqueues (FSDP2's in each post-backward, `.item()` reading one back) waits behind what
is queued: this many pieces (`cpu_offload.COPY_PIECE_BYTES`), not a chunk's or a step's. Two keep
the engine busy while the step's thread queues the next."""


class CopyStreams:
    """An H2D stream, a D2H stream, and per staging slot the events that order them.

    loaded[s]: slot s holds its chunk's state (H2D done); stepped[s]: the
    update of slot s is enqueued (compute done); freed[s]: slot s is written
    back and may be refilled (D2H done).
    """

    def __init__(self, device: torch.device, slots: int) -> None:
        self.device = device
        self.async_copies = device.type != "cpu"
        self.h2d = self.new_stream()
        self.d2h = self.new_stream()
        self.loaded: list[torch.Event | None] = []
        self.stepped: list[torch.Event | None] = []
        self.freed: list[torch.Event | None] = []
        self.ensure_slots(slots)
        self._queued: dict[int, deque[torch.Event]] = {}  # id(stream) -> paced copies

    def ensure_slots(self, slots: int) -> None:
        """Events for at least `slots` staging slots (the backward's extra slots add some)."""
        for events in (self.loaded, self.stepped, self.freed):
            events += [self.new_event() for _ in range(slots - len(events))]

    def new_stream(self) -> torch.Stream | None:
        return torch.Stream(device=self.device) if self.async_copies else None

    def new_event(self) -> torch.Event | None:
        return torch.Event(device=self.device) if self.async_copies else None

    def mark(self, stream: torch.Stream | None) -> torch.Event | None:
        """A fresh event recorded on `stream` now."""
        event = self.new_event()
        self.record(event, stream)
        return event

    def current(self) -> torch.Stream | None:
        return torch.accelerator.current_stream(self.device) if self.async_copies else None

    @contextlib.contextmanager
    def on(self, stream: torch.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def copy(self, dst: Tensor, src: Tensor, stream: torch.Stream | None, paced: bool) -> None:
        """Enqueue `dst.copy_(src)` on `stream`; `paced`, first wait on the host until fewer
        than `PACED_COPIES` of that stream's paced copies are still queued (only on a
        thread the trainer does not wait on)."""
        queued = self._queued.setdefault(id(stream), deque()) if paced else None
        if queued is not None and self.async_copies:
            while len(queued) >= PACED_COPIES:
                queued.popleft().synchronize()
        with self.on(stream):
            dst.copy_(src, non_blocking=True)
        if queued is not None and self.async_copies:
            queued.append(self.mark(stream))

    def record(self, event: torch.Event | None, stream: torch.Stream | None) -> None:
        if self.async_copies:
            event.record(stream)

    def wait(self, stream: torch.Stream | None, event: torch.Event | None) -> None:
        if self.async_copies:
            stream.wait_event(event)
