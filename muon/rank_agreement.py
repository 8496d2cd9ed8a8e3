"""Every rank of a mesh must build the same Muon plan: the exchanges pair each rank's
pieces with its peers' by position, so ranks that disagree on the Muon params (one
froze a param, or built its groups otherwise) or on a setting that shapes the buckets
(`bucket_cap_bytes`, `ns_dtype`) send sizes their peers do not expect. gloo aborts the
process ("Received data size doesn't match expected size"); NCCL may hang or exchange
the wrong bytes. So each plan build gathers a digest of what shaped it from every rank
of each mesh of its params (axis by axis, so every rank holds them all), and on a
mismatch every rank raises the same error, naming the first difference, before any
exchange runs.

`PlanDescription` and `first_difference` are pure; `check_ranks_agree` runs the
collectives. It runs at plan builds only (the first step, then when the params or
settings change), as every rank builds then; it reads its result on the host.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PlanDescription:
    """What shapes a rank's Muon plan, without what differs between ranks by design
    (device indices, mesh coordinates)."""

    params: tuple[tuple[Any, ...], ...]
    """Per Muon param, in order: its group, row blocks, global shape, dtype, device type
    and placements."""
    settings: tuple[tuple[str, Any], ...]
    """(name, value) of each optimizer-wide setting the plan reads."""
    labels: tuple[str, ...] = ()
    """Per Muon param, how an error names it (not compared)."""

    def digest(self) -> bytes:
        return hashlib.sha256(repr((self.params, self.settings)).encode()).digest()


PARAM_FIELDS = ("group", "row_blocks", "shape", "dtype", "device type", "placements")


class RanksDisagree(ValueError):
    """Ranks do not build the same Muon plan. Raised on every rank of the meshes at once:
    a caller that agrees on more (an offload wrapper's own settings) must not wait for
    peers in another agreement after it (`raised_on_every_rank`)."""

    raised_on_every_rank = True


def first_difference(mine: PlanDescription, theirs: PlanDescription) -> str | None:
    """The first thing two ranks' descriptions disagree on, in words; None if they agree."""
    for (name, value), (_, other) in zip(mine.settings, theirs.settings, strict=True):
        if value != other:
            return f"{name}: {value!r} vs {other!r}"
    for k, (a, b) in enumerate(zip(mine.params, theirs.params, strict=False)):
        if a != b:
            field = next(f for f, x, y in zip(PARAM_FIELDS, a, b, strict=True) if x != y)
            return (
                f"Muon param {k} ({_label(mine, k)} vs {_label(theirs, k)}) differs in "
                f"{field}: {_field(a, field)} vs {_field(b, field)}"
            )
    if len(mine.params) != len(theirs.params):
        longer = mine if len(mine.params) > len(theirs.params) else theirs
        extra = min(len(mine.params), len(theirs.params))
        return (
            f"{len(mine.params)} vs {len(theirs.params)} Muon params; the first one only one "
            f"side has is param {extra} ({_label(longer, extra)})"
        )
    return None


def _label(description: PlanDescription, k: int) -> str:
    return description.labels[k] if k < len(description.labels) else f"param {k}"


def _field(values: tuple[Any, ...], field: str) -> str:
    value = values[PARAM_FIELDS.index(field)]
    return str(tuple(value)) if field == "shape" else str(value)


def check_ranks_agree(
    description: PlanDescription,
    meshes: Sequence[tuple[Sequence[dist.ProcessGroup], torch.device]],
    all_meshes: int,
) -> None:
    """Raise on every rank of `meshes` (each the groups of a mesh's axes, with the device
    its collectives run on; every rank passes its meshes in the same order) if any two
    ranks of one mesh describe their plans differently. Each mesh's digests are gathered
    axis after axis, so that every rank of the mesh holds all of them and decides alike
    (a rank whose own axis agreed would otherwise wait on one that raised). `all_meshes`:
    how many meshes the params have in all, the same on every rank (a rank may be in
    fewer of them)."""
    refusal = None  # raised once every mesh is checked: a rank must not leave a peer waiting
    for groups, device in meshes:
        digests = _gather_over_mesh((dist.get_rank(), description.digest()), groups, device)
        if len({digest for _, digest in digests}) == 1:
            continue
        # Only on a mismatch: the whole descriptions, to say what differs.
        described = dict(_gather_over_mesh((dist.get_rank(), description), groups, device))
        if refusal is not None:
            continue
        first, digest = digests[0]
        odd = next(rank for rank, other in digests if other != digest)
        difference = first_difference(described[first], described[odd])
        refusal = RanksDisagree(
            f"ranks {first} and {odd} (of a mesh of ranks {sorted(described)}) do not build "
            f"the same Muon plan, which its exchanges need: "
            f"{difference or 'their descriptions differ in form'}. Every rank of a mesh must "
            "give the optimizer the same params (global shapes, dtypes, placements, in the "
            "same groups and order: freeze a param on every rank or none) and the same settings"
        )
    if all_meshes > 1 and meshes and _seen_anywhere(refusal is not None, meshes, all_meshes):
        # meshes that cross: a rank whose own meshes agree waits on peers that refuse
        raise refusal or RanksDisagree(
            "ranks of another mesh of this optimizer's Muon params do not build the same "
            "Muon plan (their error names the difference), so this rank's exchanges would "
            "wait on them"
        )
    if refusal is not None:
        raise refusal


def _seen_anywhere(
    seen: bool, meshes: Sequence[tuple[Sequence[dist.ProcessGroup], torch.device]], rounds: int
) -> bool:
    """Whether any rank of any of `meshes` saw `seen`: a flag reduced over every axis of
    every mesh of this rank, `rounds` times (the meshes in all: every rank as many), so
    that it crosses from mesh to mesh to every rank."""
    flag = torch.tensor([int(seen)], device=meshes[0][1])
    for _ in range(rounds):
        for groups, device in meshes:
            flag = flag.to(device)
            for group in groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _gather_over_mesh(
    value: Any, groups: Sequence[dist.ProcessGroup], device: torch.device
) -> list[Any]:
    """Every rank's `value` in the mesh whose axes are `groups`, on every rank of it, in
    global rank order: gathered over the first axis, those lists over the next, and on."""
    values = [value]
    for group in groups:
        gathered = _gather(pickle.dumps(values), group, device)
        values = [v for peer in gathered for v in pickle.loads(peer)]
    return sorted(values, key=lambda item: item[0])


def _gather(data: bytes, group: dist.ProcessGroup, device: torch.device) -> list[bytes]:
    """Every rank's `data` (of any length), gathered as tensors on `device`: the object
    collectives pick the device from `torch.cuda.current_device()`, which a trainer
    need not have set."""
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(data)], device=device), group=group)
    counts = [int(n) for n in torch.cat(lengths).tolist()]
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    rows = [torch.zeros_like(padded) for _ in range(size)]
    dist.all_gather(rows, padded, group=group)
    # bytes by way of a list: torch's CPU wheels do not need numpy
    return [bytes(row[:n].cpu().tolist()) for row, n in zip(rows, counts, strict=True)]
