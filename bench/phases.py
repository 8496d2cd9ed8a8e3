"""Where a training step's time goes, phase by phase, on the device and on the host.

Marks at phase boundaries: a CUDA event on the current (trainer's) stream and the
host clock, side by side. A phase's device time is the gap between its events (the
trainer's stream reaching them, waits for other streams included); its host time
is the gap between the host's marks. A phase whose device time about equals its
host time had the stream waiting for the host to enqueue work (host-bound: an
overlapped step's chunk work enqueued from forward hooks would show so); one far
longer on the device than on the host was waiting for the device (its kernels,
or other streams' work such as state copies).

Phases of a step, in order: to the first decoder layer (embedding, the root FSDP
unit and the first layer's waits), the decoder layers, head and loss, backward,
and `optimizer.step()`. The first-layer and head marks are forward pre-hooks,
registered after any others (after FSDP2's unshard and the offload overlap's
waits); only a step's first call counts (activation checkpointing reruns layers
in the backward).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

PHASES = ("to layer 0", "layers", "head + loss", "backward", "step()")


class PhaseMarks:
    """Marks of each step's phases; `summary()` waits for the events and returns medians."""

    def __init__(self, first_layer: nn.Module, head: nn.Module, device: torch.device) -> None:
        self._device = device
        self._steps: list[list[tuple[Any, float]]] = []
        self._hooks = [
            first_layer.register_forward_pre_hook(lambda *_: self._mark_once(1)),
            head.register_forward_pre_hook(lambda *_: self._mark_once(2)),
        ]

    def begin(self) -> None:
        """A step starts (before its forward)."""
        self._steps.append([])
        self.mark()

    def mark(self) -> None:
        """The current phase ends here."""
        if not self._steps:
            return
        event = None
        if self._device.type == "cuda":  # generic: comparable with bench.link_timeline's
            event = torch.Event(device=self._device, enable_timing=True)
            event.record()
        self._steps[-1].append((event, time.perf_counter()))

    def _mark_once(self, position: int) -> None:
        if self._steps and len(self._steps[-1]) == position:
            self.mark()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def events(self) -> list[list[Any]]:
        """Each complete step's device events at its marks (on the CPU, None each)."""
        return [[e for e, _ in marks] for marks in self._steps if len(marks) == len(PHASES) + 1]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase, the median device ms (None on the CPU) and host ms over the steps."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        complete = [marks for marks in self._steps if len(marks) == len(PHASES) + 1]
        result = {}
        for index, phase in enumerate(PHASES):
            pairs = [(marks[index], marks[index + 1]) for marks in complete]
            device_ms = None
            if self._device.type == "cuda":
                device_ms = statistics.median(a[0].elapsed_time(b[0]) for a, b in pairs)
            host_ms = statistics.median(1e3 * (b[1] - a[1]) for a, b in pairs)
            result[phase] = {"device_ms": device_ms, "host_ms": host_ms}
        return result


def decoder_layers_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The first decoder layer and the LM head of a transformers causal LM or `bench.model`."""
    body = getattr(model, "model", model)
    return body.layers[0], model.lm_head
