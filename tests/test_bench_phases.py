"""bench.phases: one mark per phase boundary, whatever reruns the hooked modules."""

from __future__ import annotations

import torch
from torch import nn

from bench.phases import PHASES, PhaseMarks


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.lm_head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, reruns: int) -> torch.Tensor:
        for _ in range(1 + reruns):  # as activation checkpointing reruns layers
            y = self.layers[1](self.layers[0](x))
        return self.lm_head(y)


def test_each_step_has_one_mark_per_boundary_and_a_time_per_phase():
    model = _Tiny()
    marks = PhaseMarks(model.layers[0], model.lm_head, torch.device("cpu"))
    model(torch.ones(2, 4), reruns=0)  # before the first begin(): not marked
    for reruns in (0, 2):
        marks.begin()
        loss = model(torch.ones(2, 4), reruns).sum()
        marks.mark()
        loss.backward()
        marks.mark()
        marks.mark()  # as after optimizer.step()
    assert [len(step) for step in marks._steps] == [len(PHASES) + 1] * 2
    summary = marks.summary()
    assert list(summary) == list(PHASES)
    assert all(t["device_ms"] is None and t["host_ms"] >= 0 for t in summary.values())
    marks.close()
    marks.begin()
    model(torch.ones(2, 4), reruns=0)
    assert len(marks._steps[-1]) == 1  # the hooks are gone
