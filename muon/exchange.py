"""Moves bucket pieces to their owners and results back with `all_to_all_single`.

The caller allocates a bucket's buffers when the bucket starts, at exactly the
plan's sizes (`ExchangePlan.send_numel`, `recv_numel`, `full_numel`), and drops
them when it finishes. One bucket's round trip, for an `ExchangePlan`:

1. `send_to_owners`: with this rank's pieces packed in (owner, matrix) order
   into their `send_slots`, start `all_to_all_single` into `recv` with the
   plan's split sizes.
2. `assemble`: at the owner, copy received pieces into the full matrices
   (row pieces into row slices, Shard(1) pieces into column slices).
3. `return_results`: pack the owner's result pieces into `recv` (same layout
   it arrived in) and start the reverse `all_to_all_single` into `send`; each
   rank then finds its result pieces where it packed its inputs (`send_slots`).
4. A spread bucket (HSDP, `ExchangePlan.replica_splits`): steps 1-3 move only this
   replica's region of `send` (the matrices this replica owns);
   `share_across_replicas` then gathers every replica's region over the replica
   axis into the others, so every region holds its results.

The collectives are asynchronous: on NCCL `Work.wait()` only orders the
current stream after the collective, so nothing here syncs the host.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch import Tensor

from muon.planning import ExchangePlan, Piece


def local_rect(source: Tensor, piece: Piece) -> Tensor:
    """The rectangle of `source` (this rank's local 2-D block of a matrix) that `piece` covers."""
    rows, cols = piece.shape
    row0, col0 = piece.local_row0, piece.local_col0
    return source[row0 : row0 + rows, col0 : col0 + cols]


def _matrix_rect(matrix: Tensor, piece: Piece) -> Tensor:
    return matrix[piece.rows[0] : piece.rows[1], piece.cols[0] : piece.cols[1]]


def _slot(buffer: Tensor, piece: Piece) -> Tensor:
    return buffer[piece.offset : piece.offset + piece.numel].view(piece.shape)


def _region(plan: ExchangePlan, send: Tensor) -> Tensor:
    """The part of `send` exchanged over the exchange axis (all of it unless spread)."""
    start, stop = plan.region
    return send[start:stop]


def send_slots(plan: ExchangePlan, send: Tensor) -> list[tuple[Piece, Tensor]]:
    """This rank's pieces with their views in `send`.

    The caller packs each piece there before `send_to_owners`; after
    `return_results` completes, each holds that piece of the result.
    """
    return [(piece, _slot(send, piece)) for piece in plan.send_pieces]


def send_to_owners(
    plan: ExchangePlan, send: Tensor, recv: Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """Start the exchange of the packed `send` (see `send_slots`) into `recv`."""
    return dist.all_to_all_single(
        recv,
        _region(plan, send),
        output_split_sizes=list(plan.recv_splits),
        input_split_sizes=list(plan.send_splits),
        group=group,
        async_op=True,
    )


def assemble(plan: ExchangePlan, recv: Tensor, full: Mapping[int, Tensor]) -> None:
    """Copy received pieces into `full[matrix]`, the owned matrices' full views."""
    for piece in plan.recv_pieces:
        _matrix_rect(full[piece.matrix], piece).copy_(_slot(recv, piece))


def return_results(
    plan: ExchangePlan,
    results: Mapping[int, Tensor],
    send: Tensor,
    recv: Tensor,
    group: dist.ProcessGroup,
) -> dist.Work:
    """Pack owned `results[matrix]` into `recv` and start the reverse exchange into `send`."""
    for piece in plan.recv_pieces:
        _slot(recv, piece).copy_(_matrix_rect(results[piece.matrix], piece))
    return dist.all_to_all_single(
        _region(plan, send),
        recv,
        output_split_sizes=list(plan.send_splits),
        input_split_sizes=list(plan.recv_splits),
        group=group,
        async_op=True,
    )


def share_across_replicas(
    plan: ExchangePlan, send: Tensor, gathered: Tensor, group: dist.ProcessGroup
) -> None:
    """After `return_results` of a spread bucket: every replica's region of `send` into the
    others', through `gathered` (`ExchangePlan.gather_buffers_numel`: a region-sized input,
    then one `gather_numel` slot per replica: all-gather takes one size from every rank).
    Waits for the gather, then copies the other replicas' regions in."""
    width = plan.gather_numel
    start, stop = plan.region
    contribution, slots = gathered[:width], gathered[width:].view(-1, width)
    contribution[: stop - start].copy_(send[start:stop])
    dist.all_gather(list(slots.unbind(0)), contribution, group=group, async_op=True).wait()
    offset = 0
    for replica, size in enumerate(plan.replica_splits):
        if replica != plan.replica:
            send[offset : offset + size].copy_(slots[replica, :size])
        offset += size
