"""Side streams and events for the copy pipeline, device-generic.

On the host (CPU-only torch) there is one synchronous queue: streams and
events become no-ops and the pipeline runs in program order, so CI exercises
the same chunk logic as a GPU run (and `tests/test_offload_async_paths.py` the
asynchronous branches, with stand-in streams and events).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


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

    def record(self, event: torch.Event | None, stream: torch.Stream | None) -> None:
        if self.async_copies:
            event.record(stream)

    def wait(self, stream: torch.Stream | None, event: torch.Event | None) -> None:
        if self.async_copies:
            stream.wait_event(event)
