"""A thread that enqueues an overlapped step's device work, off the trainer's path.

With forward overlap the step's chunks (copies in, update, copies out) would
otherwise be enqueued by the next forward's hooks, on the trainer's thread: the
host time of enqueueing them, and of pacing the copies, would lengthen a forward
that is often host-paced already. The runner enqueues them instead, in step
order, while the trainer's forward only waits: on the host until the chunk it
needs is enqueued (`wait_enqueued`), then on the device for its event.

Jobs run one at a time, in the order submitted (a step, then the backward's loads
for the next one), with grads off, autocast off, and the device of the step.
An error in a job is raised on the trainer's thread by its next wait.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator

import torch


class StepRunner:
    """Runs jobs on a daemon thread of its own; one step's chunks are counted as enqueued."""

    def __init__(self, device: torch.device) -> None:
        self._device_index = (
            None
            if device.type == "cpu"
            else device.index
            if device.index is not None
            else torch.accelerator.current_device_index()
        )
        self._changed = threading.Condition()
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = 0  # jobs submitted and not done
        self._enqueued = 0  # chunks of the last step run so far
        self._step_over = True  # the last step's job has ended (done or raised)
        self._error: BaseException | None = None
        self._stopped = False
        self._thread: threading.Thread | None = None

    def run_step(self, chunks: Iterator[None]) -> None:
        """Enqueue `chunks` (each `next()` enqueues one chunk) on the thread, after the
        jobs before it."""
        with self._changed:
            self._enqueued, self._step_over = 0, False
        self.submit(lambda: self._count(chunks))

    def submit(self, job: Callable[[], None]) -> None:
        with self._changed:
            if self._stopped:
                raise RuntimeError("the step runner is stopped")
            self._jobs.append(job)
            self._busy += 1
            self._changed.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(
                target=_serve, args=(self,), name="muon-offload-step", daemon=True
            )
            self._thread.start()

    @property
    def enqueued(self) -> int:
        """Chunks of the last step enqueued so far."""
        return self._enqueued

    def wait_enqueued(self, count: int) -> None:
        """Block until `count` chunks of the last step are enqueued (or its job ended)."""
        with self._changed:
            self._changed.wait_for(lambda: self._enqueued >= count or self._step_over)
            self._raise_error()

    def drain(self) -> None:
        """Block until every job submitted so far is done."""
        with self._changed:
            self._changed.wait_for(lambda: self._busy == 0)
            self._raise_error()

    def stop(self) -> None:
        """Let the thread end once its jobs are done."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the offloaded step failed on its thread: {error!r}") from error

    def _count(self, chunks: Iterator[None]) -> None:
        error = None
        try:
            for _ in chunks:
                with self._changed:
                    self._enqueued += 1
                    self._changed.notify_all()
        except BaseException as raised:  # kept before the step ends: no waiter misses it
            error = raised
        with self._changed:
            if error is not None and self._error is None:
                self._error = error
            self._step_over = True
            self._changed.notify_all()

    def _next_job(self) -> Callable[[], None] | None:
        with self._changed:
            self._changed.wait_for(lambda: self._jobs or self._stopped)
            return self._jobs.popleft() if self._jobs else None

    def _done(self, error: BaseException | None) -> None:
        with self._changed:
            self._busy -= 1
            if error is not None and self._error is None:
                self._error = error
            self._changed.notify_all()


def _serve(runner: StepRunner) -> None:
    if runner._device_index is not None:
        torch.accelerator.set_device_index(runner._device_index)
    # A new thread starts with grads on and no autocast: the update must not record a graph.
    with torch.no_grad():
        while (job := runner._next_job()) is not None:
            try:
                job()
            except BaseException as error:  # raised to the trainer at its next wait
                runner._done(error)
            else:
                runner._done(None)
            del job  # the job holds the optimizer: not while idle
