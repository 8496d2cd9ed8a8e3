"""Forward overlap: which module's forward first reads which params, and the
object that runs an offloaded step's chunks as the next forward reaches them.

With forward overlap the offloaded step's chunks update params on a side stream
while the next forward runs. Nothing may read or write a param before the chunk
holding it has stepped:
- a forward pre-hook on each module that reads params (prepended, so it runs before
  FSDP2's own unshard hook) waits for their chunk (and for the chunks of the modules
  FSDP2 prefetches from there), and enqueues the chunks a few ahead of the forward;
- a torch function mode, on the trainer's thread only while a step is pending, makes
  any torch call given a param whose chunk has not landed wait for it first: a tied
  weight read by the module the hooks did not expect, a functional read of another
  module's weight, `model.state_dict()` / `load_state_dict()`, an in-place edit.
  Inside an FSDP2 forward it is on only in each plan's first overlapped forward, which
  teaches the hooks the reads they do not see, and in every later one where that forward
  found such a read (see `ForwardOverlap.__init__`); a module's `state_dict()` and
  `load_state_dict()` put it back (a Ctrl-C inside the forward ran no hook to end the
  step).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from offload.residency import StepTimer
from offload.step_schedule import StepSchedule
from offload.streams import CopyStreams
from offload.subset_step import dtensor_local

PENDING_READ_REASON = (
    "a param whose optimizer step is still pending (CPUOffloadOptimizer(overlap_forward=...)) "
    "is read inside compiled code (fullgraph=True, or a torch.cond / while_loop branch): its "
    "update runs eagerly, outside the graph. Read it through its module's forward (whose "
    "hook waits before the graph), call optimizer.wait_for_optimizer_step() before that "
    "code, or compile without fullgraph=True"
)


def is_fsdp_module(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def param_owners(
    model: nn.Module, is_unit: Callable[[nn.Module], bool] = is_fsdp_module
) -> list[tuple[nn.Module, list[Tensor]]]:
    """(module, params it reads first), in module registration order (~ forward order).

    Under FSDP2 a `fully_shard`-ed module all-gathers its whole subtree's params
    minus nested FSDP2 modules' at once, so it owns all of them; without FSDP2
    each module owns its direct params (its forward waits for its whole subtree's,
    see `waited_params`). `is_unit` says which modules are FSDP2's (the planner names
    them on a meta-device model).
    """
    owner: dict[Tensor, nn.Module] = {}
    fsdp_modules = [m for m in model.modules() if is_unit(m)]
    if fsdp_modules:
        for module in fsdp_modules:  # pre-order: a nested module overrides its parent
            for p in module.parameters():
                owner[p] = module
    else:
        for module in model.modules():
            for p in module.parameters(recurse=False):
                owner.setdefault(p, module)
    owned: dict[nn.Module, list[Tensor]] = {}
    for p, module in owner.items():
        owned.setdefault(module, []).append(p)
    order = {m: i for i, m in enumerate(model.modules())}
    return sorted(owned.items(), key=lambda item: order[item[0]])


def in_forward_order(
    units: Sequence[Sequence[Tensor]], owners: Sequence[tuple[nn.Module, Sequence[Tensor]]]
) -> list[Sequence[Tensor]]:
    """`units` sorted by the first of `owners` (`param_owners`) that reads them, stable (the
    same on every rank): the order an overlapped step's chunks are planned in."""
    first_use = {p: i for i, (_, params) in enumerate(owners) for p in params}
    last = len(owners)
    return sorted(units, key=lambda unit: min(first_use.get(p, last) for p in unit))


def waited_params(
    module: nn.Module, is_unit: Callable[[nn.Module], bool] = is_fsdp_module
) -> list[Tensor]:
    """Params whose update `module`'s forward must wait for.

    An FSDP2 module reads only what it all-gathers. A plain module may read its
    children's params without running their forward (`nn.MultiheadAttention`
    calls `F.linear` on `out_proj.weight`), so it waits for its whole subtree.
    `is_unit` as in `param_owners`.
    """
    if is_unit(module):
        return [p for m, ps in param_owners(module, is_unit) if m is module for p in ps]
    return list(module.parameters())


def _with_shared_all_gathers(modules: Sequence[nn.Module]) -> list[list[Tensor]]:
    """`waited_params` of each module, where FSDP2 modules sharded together wait together.

    `fully_shard([norm, lm_head])` (torchtitan's wrap) makes one unit of both: whichever
    runs first all-gathers both, so each waits for both (waiting only for its own
    chunk, lm_head's forward read stale weights). Private API (`_get_fsdp_state()`, one
    state object per `fully_shard` call; torch 2.11 and 2.13).
    """
    waited = [waited_params(m) for m in modules]
    together: dict[int, list[int]] = {}
    for i, module in enumerate(modules):
        if is_fsdp_module(module):
            together.setdefault(id(module._get_fsdp_state()), []).append(i)
    for members in together.values():
        union = [p for i in members for p in waited[i]]
        for i in members:
            waited[i] = union
    return waited


def fsdp_all_gather_streams(module: nn.Module) -> list[torch.Stream]:
    """The streams FSDP2 copies `module`'s shards in on for its all-gather.

    FSDP2 orders them after the trainer's stream once per forward, at the root,
    so a wait on the trainer's stream alone does not hold back a later module's
    all-gather: they must wait for the chunk themselves. Private API
    (`_get_fsdp_state()._comm_ctx`), absent before FSDP2's lazy init and on CPU.
    """
    if not is_fsdp_module(module):
        return []
    context = getattr(module._get_fsdp_state(), "_comm_ctx", None)
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    return [getattr(context, n) for n in names if getattr(context, n, None) is not None]


def forward_prefetched(module: nn.Module) -> list[nn.Module]:
    """Modules whose all-gather FSDP2 issues in `module`'s pre-forward.

    Set by `set_modules_to_forward_prefetch`, possibly after the optimizer is built,
    so it is read at each forward. Private API (`_states_to_forward_prefetch`).
    """
    if not is_fsdp_module(module):
        return []
    states = getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", ())
    return [m for state in states for m in getattr(state, "_modules", ())]


def _fsdp_param_groups(module: nn.Module) -> list[Any]:
    """FSDP2's param groups of `module`'s unit (none for a module that is no unit).
    Private API (`_get_fsdp_state()`, its `_fsdp_param_group` in torch 2.11 and
    `_fsdp_param_groups` in 2.13)."""
    if not is_fsdp_module(module):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = state._fsdp_param_group
        groups = [] if group is None else [group]
    return list(groups)


def _fsdp_gathered(module: nn.Module) -> bool:
    """Whether FSDP2 holds `module`'s params all-gathered, or is gathering them (an
    explicit `FSDPModule.unshard()`, which no hook sees). Private API
    (`FSDPParamGroup.is_unsharded` and `_all_gather_result`; torch 2.11 and 2.13)."""
    return any(
        group.is_unsharded or group._all_gather_result is not None
        for group in _fsdp_param_groups(module)
    )


def fsdp_shard_buffers(module: nn.Module) -> dict[Tensor, Tensor]:
    """Per sharded param of `module`'s FSDP2 unit, the buffer its all-gather reads the
    shard from: `unshard()` (by hand too) copies it with no torch call on the param, and
    over a group of one rank straight into the unsharded param. Private API
    (`FSDPParamGroup.fsdp_params`, `FSDPParam.sharded_param` and `_sharded_param_data`;
    torch 2.11 and 2.13)."""
    return {
        fsdp_param.sharded_param: fsdp_param._sharded_param_data
        for group in _fsdp_param_groups(module)
        for fsdp_param in group.fsdp_params
        if getattr(fsdp_param, "_sharded_param_data", None) is not None
    }


def _check_reads_are_seen(
    model: nn.Module, owners: list[tuple[nn.Module, list[Tensor]]], params: Sequence[Tensor]
) -> bool:
    """Refuse params whose reads neither the hooks nor the pending-read mode can see;
    True when the hooks alone see every read the forward makes.

    FSDP2 all-gathers a unit's params from their local shards, not through a torch call
    on the param, so only a hook on the unit's module sees that read: every sharded
    (DTensor) param must belong to an FSDP2 module inside `model`. Then its forward reads
    only the all-gathered copies, after the hooks waited. Other params are seen wherever
    they are read, by the mode.
    """
    owned = {p for module, ps in owners if is_fsdp_module(module) for p in ps}
    for index, param in enumerate(params):
        if hasattr(param, "placements") and param not in owned:
            raise ValueError(
                f"param {index} (shape {tuple(param.shape)}) is a sharded DTensor that no "
                f"FSDP2 module inside overlap_forward ({type(model).__name__}) manages: its "
                "all-gather would read it before its update lands. Pass the root module that "
                "was fully_shard-ed (the one the trainer calls) as overlap_forward"
            )
    return all(p in owned for p in params)


class ForwardOverlap:
    """Runs an offloaded step's chunks as the next forward reaches the modules that read them.

    Lifecycle: `start(pending)` takes a step's chunk generator (each `next()`
    enqueues one chunk on `side_stream`) and enqueues the first few; the model's
    forward hooks enqueue the rest a few chunks ahead of the forward and make each
    module (and its FSDP2 all-gather streams) wait for its chunk; when the forward
    returns, the trainer's stream waits for the last chunk. `finish()` enqueues
    whatever is left. `close()` removes the hooks.

    The hooks hold this object weakly and it is the optimizer's alone, so a model
    never keeps an optimizer (or its pinned slabs) alive; once collected, its hooks
    are removed.
    """

    def __init__(self, model: nn.Module, params: Sequence[Tensor], streams: CopyStreams) -> None:
        self._streams = streams
        self.owners = param_owners(model)
        self._model = weakref.ref(model)
        self.check_holds(params)
        # FSDP2 units hold every param: a unit's forward reads only all-gathered copies,
        # so the mode leaves the stack at the forward's start (nothing for torch.compile
        # to trace; the forward's end finishes the step), but in the first overlapped
        # forward of each plan that trains as the one before the step did (an evaluation
        # may skip reads training makes), runs to its end, and finds no chunk landed
        # before it (by a log of weights): there it finds reads outside a unit's
        # forward (a term over another unit's sharded params, a state counter), and each
        # makes the owner whose hook ran last wait for the chunk it read from then on (-1:
        # before any owner's, the forward's start). Where it found one, the mode stays on
        # in later forwards too: that owner may not run in every forward (LayerDrop).
        self._hooks_see_forward = _check_reads_are_seen(model, self.owners, params)
        self._trace_reads = False
        self._tracing = False
        self._reads_outside_units = False
        self._reading_owner = -1  # in a traced forward, the owner whose pre-hook ran last
        self._in_forward = False
        self.runs_collectives = False  # the pending step's chunks communicate
        self._group_at_step = False  # a default process group was up at step()
        self._warned_rank_local_reads = False
        self._start_chunk = -1  # what the forward's start waits for (read before any owner)
        self._owner_index = {module: i for i, (module, _) in enumerate(self.owners)}
        self._owner_is_unit = [is_fsdp_module(module) for module, _ in self.owners]
        self._units = [m for m, _ in self.owners if is_fsdp_module(m)]
        # per owner, the params its all-gather holds (found once: every re-plan asks)
        self._owner_waits = _with_shared_all_gathers([m for m, _ in self.owners])
        optimized = {id(p) for p in params}
        self._owner_stepped = [  # of those, the optimizer's
            [p for p in waited if id(p) in optimized] for waited in self._owner_waits
        ]
        # The stream the last wait was on, and the last chunk it has waited for this step.
        self._waited: tuple[torch.Stream | None, int] = (None, -1)
        # current at `step()`, and the forward's after it (`_before_forward`)
        self._step_stream: torch.Stream | None = None
        self._trainer_stream: torch.Stream | None = None
        names = {module: name for name, module in model.named_modules()}
        self._owner_names = [names.get(module, "") or "(the root)" for module, _ in self.owners]
        # Whether the forward now running ends the first forward's look (`_after_forward`);
        # train() or eval() as the last forward with grads, and as the one before the step.
        self._ends_look = False
        self._blocked_looks = 0
        self._last_trained_in = self._trains_in = True
        self.side_stream = streams.new_stream()
        self.chunk_done: list[torch.Event | None] = []
        self._module_chunk: list[int] = []
        self._module_needs: list[int] = []
        self._step_bytes = 0
        self._pending: Iterator[None] | None = None
        self._enqueued = 0  # chunks of the pending step enqueued so far
        self._in_flight = False  # the next forward must still wait for the pending step
        self.timer: StepTimer | None = None
        """While "auto" measures: times the trainer stream's waits for chunks in the forward."""
        self.backward_reached: Callable[[int, int], None] | None = None
        """Called as the backward of the first forward after a step passes each owner module
        that forward ran on an input needing grad (once the grad of that input is computed),
        with (how many of them the backward has passed, how many there are)."""
        self.written_back: Callable[[], None] | None = None
        """Blocks the host until the finished step's state is home (written back): what a
        read of a state tensor held from an earlier step waits for."""
        self.interrupted: Callable[[], str | None] | None = None
        """Why the last step is only partly applied (a chunk raised), or None."""
        self._watch_inputs = False  # in the first forward after a step
        self._watch = _Watch()  # that forward's hooks on its owner modules' inputs
        self._chunk_needs: list[int] = []  # state bytes from the step's start to each chunk's end
        self._param_chunk: dict[Tensor, int] = {}  # the chunk each param's update lands with
        self._shared_storages: dict[int, _StorageSpans] = {}  # `_shared_storage_spans`
        self._late_params: list[list[Tensor]] = []  # see `set_chunks`
        self._late_storage: list[list[int]] = []  # their data pointers at `start`
        self._up_front = -1  # the last chunk enqueued when `start` returns
        self._ahead_of: Sequence[int] = ()  # per chunk: the last enqueued once it is needed
        self._advancing = threading.RLock()
        # The autocast, inference mode and default dtype `step()` was called in: its
        # chunks run in them wherever they run.
        self._autocast: dict[str, Any] = {"enabled": False}
        self._inference_mode = False
        self._default_dtype = torch.get_default_dtype()
        self._step_thread: int | None = None  # the thread that called step()
        self._step_modes: tuple[Any, ...] = ()  # the torch function modes step() ran in
        self._reads = _PendingReads(weakref.ref(self))
        fast_path = _fast_path_modules(model)
        self._fast_path = fast_path
        self._fast_path_names = [names.get(m, "") or "(the root)" for m in fast_path]
        self._warned_slow_path = False
        self._warned_no_forward_end = False
        handles = _register_hooks(model, self.owners, fast_path, weakref.ref(self))
        self.dropped_pending: list[Callable[[], None]] = []
        """Called if this object is collected with a step pending (none may hold it)."""
        self._remove_hooks = weakref.finalize(
            self, _remove, handles, self._reads, self.dropped_pending
        )
        self._remove_hooks.atexit = False  # at exit a pending step no longer matters

    def refuse_gathered_units(self) -> None:
        """At `step()`: an FSDP2 unit still all-gathered would not gather again in the next
        forward, which would read its weights from before this step (with or without
        offload). After a backward FSDP2 reshards every unit; a forward without one since
        (an evaluation between backward() and step()) leaves the root gathered. Refused,
        naming the unit, before anything steps."""
        for index, (module, _) in enumerate(self.owners):
            if not (self._owner_is_unit[index] and _fsdp_gathered(module)):
                continue  # the usual case: no grad scanned on the step's host path
            # A unit whose params this step leaves alone (frozen, kept gathered) goes stale never.
            if any(p.grad is not None for p in self._owner_stepped[index]):
                raise RuntimeError(
                    f"module {self._owner_names[index]!r} ({type(module).__name__}) is "
                    "all-gathered at step(), so the next forward would read its weights from "
                    "before this step. A forward since the backward (an evaluation between "
                    "backward() and step()), set_reshard_after_backward(False) or unshard() "
                    "leaves it so: evaluate after step(), or call reshard() on the FSDP2 "
                    "modules before step()"
                )

    def check_holds(self, params: Sequence[Tensor], stepping: bool = False) -> None:
        """Refuse a model that holds none of `params`: its forward would never reach a
        chunk. At the first step (`stepping`) that means params replaced since the
        optimizer was built: `fully_shard` makes new ones, and the optimizer would step
        the old, which get no grads, while the model trains nothing. Where it holds some,
        those it does not that have no grad there, while it holds trainable params of
        their shapes that are not among `params`, are warned of: `fully_shard` on part of
        the model (a param outside it may be unused by design, so not refused)."""
        model = self._model()
        held = {id(p) for p in model.parameters()} if model is not None else set()
        if model is None:
            return
        if any(id(p) in held for p in params):
            if stepping:
                self._warn_of_replaced(model, params, held)
            return
        if stepping:
            raise ValueError(
                f"overlap_forward ({type(model).__name__}) holds none of the {len(params)} "
                "params being optimized any more: its params were replaced since the "
                "optimizer was built (fully_shard(model) makes new ones), and stepping the "
                "old ones would train nothing. Build the optimizer after fully_shard"
            )
        raise ValueError(
            f"overlap_forward ({type(model).__name__}) holds none of the {len(params)} "
            "params being optimized, so its forward never reaches a chunk and no step "
            "would overlap: pass the model whose forward reads them (the root module you "
            "fully_shard, or the plain module), or leave overlap_forward None"
        )

    @staticmethod
    def _warn_of_replaced(model: nn.Module, params: Sequence[Tensor], held: set[int]) -> None:
        """Warn of `params` the model does not hold that have no grad while it holds
        trainable params of their shapes that are not among them (`check_holds`)."""
        optimized = {id(p) for p in params}
        untrained = {
            tuple(p.shape) for p in model.parameters() if p.requires_grad and id(p) not in optimized
        }
        stale = [
            i
            for i, p in enumerate(params)
            if id(p) not in held and p.grad is None and tuple(p.shape) in untrained
        ]
        if stale:
            warnings.warn(
                f"params {stale[:8]} of the {len(params)} being optimized (positions in the "
                f"optimizer's groups) are not overlap_forward's ({type(model).__name__}) "
                "and have no grad, while it holds trainable params of their shapes that no "
                "step updates: fully_shard replaced them after the optimizer was built, so "
                "the model's new ones train nothing. Build the optimizer after fully_shard",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    def close(self) -> None:
        """Remove the hooks; the model's forward no longer calls into this object."""
        self._remove_hooks()
        self._pending = None
        self._in_flight = False
        self._watch_inputs, self._watch = False, _Watch()

    def first_wait(self, params: Collection[Tensor]) -> list[Tensor]:
        """Of `params`, those the next forward waits for first: the first owner module's
        that reads any of them, with those of the modules FSDP2 all-gathers with it (one
        unit, or prefetched from its pre-forward: `_before_module` waits for them too)."""
        waited = self._owner_waits
        for index, own in enumerate(waited):
            if any(p in params for p in own):
                first = {id(p): p for i in self._gathered_with(index) for p in waited[i]}
                return [p for p in first.values() if p in params]
        return []

    def forward_order(self, units: Sequence[Sequence[Tensor]]) -> list[Sequence[Tensor]]:
        """Units sorted by the first owner module that reads them (`in_forward_order`)."""
        return in_forward_order(units, self.owners)

    def set_chunks(
        self,
        chunk_params: Sequence[Collection[Tensor]],
        param_end: Mapping[Tensor, int],
        schedule: StepSchedule,
    ) -> None:
        """The params each chunk updates, in step order (whole or in slices), where each
        param's unit ends in the step (rank-invariant state bytes from the step's start:
        what a wait for it needs done, as the timer records it), and the step's schedule
        (how far ahead of the forward its chunks are enqueued)."""
        self._up_front, self._ahead_of = schedule.up_front, schedule.ahead_of
        chunk_of: dict[Tensor, int] = {}
        for c, params in enumerate(chunk_params):
            for p in params:
                chunk_of[p] = c  # a param cut into slices is done with its last chunk
        waited = self._owner_waits
        self._module_chunk = [
            max((chunk_of[p] for p in params if p in chunk_of), default=-1) for params in waited
        ]
        self._module_needs = [
            max((param_end[p] for p in params if p in chunk_of), default=0) for params in waited
        ]
        self._step_bytes = max(param_end.values(), default=0)
        self._chunk_needs = [max((param_end[p] for p in ps), default=0) for ps in chunk_params]
        self._chunk_needs = list(itertools.accumulate(self._chunk_needs, max))
        self._param_chunk = {p: c for p, c in chunk_of.items()}
        # per plan: a param given other storage while pending is refused (`_refuse_replaced`)
        self._shared_storages = _shared_storage_spans(self._param_chunk)
        # Per chunk the step enqueues after it returns, its plain params (a DTensor's local
        # storage is FSDP2's to manage), to check that none was given other storage while
        # pending (`_refuse_replaced`); none for a chunk ready when the step starts
        # (resident, or loaded in the backward), which updates inside `step()`
        ready = set(schedule.ready)
        self._late_params = [
            [] if c in ready else [p for p in chunk_params[c] if not hasattr(p, "placements")]
            for c in range(schedule.up_front + 1, len(chunk_params))
        ]
        self._trace_reads, self._start_chunk = self._hooks_see_forward, -1
        self._blocked_looks = 0  # forwards whose look a read before them left incomplete
        self._reads_outside_units = False
        self.chunk_done = [self._streams.new_event() for _ in chunk_params]

    def start(
        self,
        pending: Iterator[None],
        grads: Iterable[Tensor],
        state_scalars: Mapping[Tensor, Sequence[Tensor]],
        state_homes: Collection[Tensor],
        runs_collectives: bool,
    ) -> None:
        """Run `pending`'s chunks on the side stream, from where the trainer's stream is
        now (grads reduced and clipped); the first few are enqueued at once. Until each
        chunk lands, torch calls on its params, their grads or their state tensors that the
        step updates in place (`state_scalars`: per param, `step` and the like) wait for it;
        torch calls on the offloaded state's homes (`state_homes`: what `state` hands out
        between steps, and a logger may hold, and the slabs they are views of) wait for the
        whole step to be written back. `runs_collectives`: the chunks' updates communicate
        (`SubsetStep.runs_collectives`)."""
        # One step at a time: a thread finishing the last step (`finish`) ends before
        # this one starts, or it would end this one's reads.
        with self._advancing:
            self.runs_collectives = runs_collectives
            self._group_at_step = _group_up()
            self._in_forward = False  # a forward interrupted by a BaseException ran no after-hook
            self._trains_in = self._last_trained_in  # the forward the step's grads came from
            streams, side = self._streams, self.side_stream
            device_type = streams.device.type
            self._autocast = {
                "enabled": torch.is_autocast_enabled(device_type),
                "dtype": torch.get_autocast_dtype(device_type),
            }
            self._inference_mode = torch.is_inference_mode_enabled()
            self._default_dtype, self._step_thread = (
                torch.get_default_dtype(),
                threading.get_ident(),
            )
            self._step_modes = tuple(
                m for m in _function_modes() if not isinstance(m, _PendingReads)
            )
            self._step_stream = self._trainer_stream = streams.current()
            streams.wait(side, streams.mark(self._trainer_stream))
            if side is not None:  # grads the trainer drops must outlive the side stream's reads
                for grad in grads:
                    grad.record_stream(side)
            self._pending = pending
            self._enqueued = 0
            self._late_storage = [[p.data_ptr() for p in ps] for ps in self._late_params]
            self._in_flight = True
            self._waited = (None, -1)  # the events are recorded anew
            self._warn_if_forward_never_ended()
            self._watch_inputs, self._watch = self.backward_reached is not None, _Watch()
            self.advance(self._up_front, in_step=True)
            self._reads.push(self, state_scalars, state_homes)

    def chunks_held(self) -> threading.RLock:
        """Held, as a context manager, while no chunk runs on another thread (chunks run
        holding it)."""
        return self._advancing

    @torch.compiler.disable(reason=PENDING_READ_REASON)
    def advance(self, last: int, in_step: bool = False) -> None:
        """Enqueue the pending step's chunks up to index `last`.

        Called from forward hooks and from reads inside a forward too, so the trainer's
        grad mode and torch.func transforms are switched off, autocast, inference mode and
        the default dtype are as `step()` found them, and torch.compile never traces it (a
        read inside compiled code would compile the update): the update must not change
        with where it runs, and equals the step run inside `step()`. Outside `step()`
        (`in_step`), the JIT tracer and the dispatch modes are off too (`_unrecorded`):
        those around `step()` see the chunks it runs, those around a forward none; of the
        torch function modes, only those on the stack at `step()` too stay on (one around
        the whole loop, `torch.set_default_device`'s), as `step()` would have run them (a
        chunk a read runs, from inside the pending-read mode, finds them set aside by
        torch's dispatch, and runs with none).
        One thread at a time (a checkpointing thread may wait for the step while the
        trainer's forward advances it).
        """
        if self._pending is None or self._enqueued > last:
            return
        with (
            self._advancing,
            contextlib.nullcontext() if in_step else _function_modes_kept(self._step_modes),
            torch.inference_mode(self._inference_mode),
            torch.no_grad(),
            torch.autocast(self._streams.device.type, **self._autocast),
            _outside_transforms(),
            contextlib.nullcontext() if in_step else _unrecorded(),
            _default_dtype(self._default_dtype, self._step_thread),
            self._reads.suspended(),  # the step's own reads and writes of its params
        ):
            while self._pending is not None and self._enqueued <= last:
                if self._up_front < self._enqueued < len(self.chunk_done):
                    self._refuse_replaced(self._enqueued - self._up_front - 1)
                try:
                    done = next(self._pending, StopIteration) is StopIteration
                except Exception as error:
                    if self.runs_collectives and self._group_at_step and not _group_up():
                        raise RuntimeError(
                            "a chunk of the optimizer's pending step communicates (Muon's "
                            "exchanges), but the process group is gone "
                            "(destroy_process_group), so the step stopped there. Call "
                            "optimizer.wait_for_optimizer_step() (or close()) on every rank "
                            "before destroy_process_group()"
                        ) from error
                    raise
                if done:
                    self._pending = None
                else:
                    self._enqueued += 1

    def _refuse_replaced(self, late: int) -> None:
        """Before the `late`-th chunk enqueued after `step()` returned: a param of it given
        other storage since (`Tensor.set_`, which no torch function mode sees; assigning to
        a parametrized weight calls it) would take the update onto its new data, which a
        step finished in `step()` leaves as it was set. Refused, inside the step's chunks
        (the step is marked interrupted: those before it are applied)."""
        for p, storage in zip(self._late_params[late], self._late_storage[late], strict=True):
            if p.data_ptr() != storage:
                model = self._model()
                names = model.named_parameters(remove_duplicate=False) if model else ()
                name = next((n for n, q in names if q is p), f"of shape {tuple(p.shape)}")
                # once: the step is marked interrupted, and nothing of it runs any more
                pending, self._pending, self._late_params = self._pending, None, []
                pending.throw(
                    RuntimeError(
                        f"param {name} was given other storage (Tensor.set_, or an "
                        "assignment to a parametrized weight) while the optimizer step that "
                        "updates it was pending, and its update would land on the new data: "
                        "call optimizer.wait_for_optimizer_step() before replacing a param's "
                        "data"
                    )
                )

    def finish(self) -> None:
        """Enqueue every pending chunk; the current stream, the trainer's and the one `step()`
        ran on wait for the last update (nothing waits for reads once this returns)."""
        with self._advancing:  # not interleaved with `start` on another thread
            try:
                self.advance(len(self.chunk_done))
            except BaseException:
                if self.interrupted is not None and self.interrupted() is not None:
                    # A chunk raised: the step is abandoned (`CPUOffloadOptimizer.
                    # _abandon_step`) and nothing of it is pending, as where a forward's
                    # read runs the chunk (still pending, close() warned of a step dropped
                    # pending). Raised elsewhere (an interrupt between chunks, a signal
                    # handler's wait inside a chunk), the step goes on at the next wait.
                    self._pending, self._in_flight = None, False
                    self._reads.pop()
                raise
            if self._in_flight and self.chunk_done:
                last = len(self.chunk_done) - 1
                self._wait_for_chunk(last, self._step_bytes)
                # Nothing waits for reads once this returns: the forward's stream and the
                # one `step()` ran on wait too, wherever this runs.
                current = self._streams.current()
                others = [self._trainer_stream]
                if self._step_stream != self._trainer_stream:
                    others.append(self._step_stream)
                for stream in others:
                    if stream != current:
                        self._streams.wait(stream, self.chunk_done[last])
                done = self.chunk_done[last]
                if self._in_forward and done is not None:
                    # Finished inside a forward (a checkpoint thread's wait): the units it
                    # has not reached wait no more, and FSDP2 orders their all-gather
                    # streams after the trainer's once per forward, at its start.
                    gathers = {
                        s for module, _ in self.owners for s in fsdp_all_gather_streams(module)
                    }
                    for stream in gathers:
                        stream.wait_event(done)
            self._in_flight = False
            self._reads.pop()

    def _wait_for_chunk(self, chunk: int, needs: int, module: nn.Module | None = None) -> None:
        """The current stream (and `module`'s all-gather streams) wait for `chunk`'s update;
        while measuring, timed there: on the trainer's, what the overlap leaves exposed."""
        streams, done, timer = self._streams, self.chunk_done[chunk], self.timer
        current = streams.current()
        waited_on, waited_through = self._waited
        same_stream = current == waited_on
        if same_stream and chunk <= waited_through and timer is None and module is None:
            return  # this stream waited for it already (a plain model's next module)
        before = timer.mark(current) if timer is not None else None
        streams.wait(current, done)
        if current == self._trainer_stream:
            # What landed is recorded for the trainer's stream only: a read on another
            # stream that waited leaves the trainer's own unhooked reads to wait too.
            self._reads.landed_through(chunk)
        # Set once the wait is made (an interrupt inside it leaves the record as it was), in
        # one assignment (a thread finishing the step reads it whole).
        self._waited = (current, max(waited_through, chunk) if same_stream else chunk)
        if timer is not None:
            timer.waited(chunk, needs, before, timer.mark(current))
        if done is not None and module is not None:
            for stream in fsdp_all_gather_streams(module):
                stream.wait_event(done)

    @property
    def step_enqueued(self) -> bool:
        """Whether all of the last step is enqueued, the write-backs after its last chunk
        too (they are enqueued after it)."""
        return self._pending is None

    def _before_module(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._reading_owner = index
        if self._watch_inputs:
            # The user's modes see the forward's calls only. torch._C.DisableTorchFunction
            # (torch 2.11, 2.13): setting the mode stack aside and back cost more. A tensor
            # subclass's own __torch_function__ does not see these reads either (DTensor
            # has none).
            with torch._C.DisableTorchFunction():
                watched = _first_grad_tensor((*args, *kwargs.values()))
                if watched is not None:
                    # Hooked now, not held: inside a checkpointed block the input is freed
                    # as the forward goes on (holding every owner's input to the forward's
                    # end kept a plain Llama's checkpointed activations alive).
                    watch = self._watch
                    watched.register_hook(_backward_reached_hook(weakref.ref(self), watch))
                    watch.hooked += 1
        if not self._in_flight or not self._module_chunk:
            return
        if not self._owner_is_unit[index]:  # a plain model's module: its own chunk only
            chunk = self._module_chunk[index]
            if chunk >= 0:
                self.advance(self._ahead_of[chunk])
                self._wait_for_chunk(chunk, self._module_needs[index])
            return
        module = self.owners[index][0]
        if self._module_chunk[index] > self._reads.landed and _fsdp_gathered(module):
            name = self._owner_names[index]
            raise RuntimeError(
                f"module {name!r} ({type(module).__name__}) was all-gathered "
                "(FSDPModule.unshard()) while the optimizer step that updates its params was "
                "pending, so its forward would read the weights from before that step: call "
                "optimizer.wait_for_optimizer_step() before unshard(), or prefetch with "
                "set_modules_to_forward_prefetch (which waits)"
            )
        indices = self._gathered_with(index)
        chunk = max(self._module_chunk[i] for i in indices)
        if chunk < 0:
            return
        self.advance(self._ahead_of[chunk])
        self._wait_for_chunk(chunk, max(self._module_needs[i] for i in indices), module)

    def _gathered_with(self, index: int) -> list[int]:
        """Owner `index` and the owners FSDP2 prefetches in its pre-forward (all-gathered
        before their own hooks run; read at each call, as it may be set after this)."""
        prefetched = (self._owner_index.get(m) for m in forward_prefetched(self.owners[index][0]))
        return [index] + [i for i in prefetched if i is not None]

    def _before_fast_path(self, index: int) -> None:
        """torch's Transformer modules take their fused path only with no torch function
        mode on the stack, and never in training: in eval, while the pending-read mode is
        on, they run their slow path (the same math, other rounding; padded positions not
        zeroed). Said once, not mended by stepping the mode aside in their forward: reads
        in hooks around them would go unseen. Another overlapped optimizer's pending step
        does the same."""
        module = self._fast_path[index]
        if self._warned_slow_path or module.training:
            return
        if not any(isinstance(m, _PendingReads) and m.active for m in _function_modes()):
            return
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            return  # no fused path with grads to compute either
        self._warned_slow_path = True
        warnings.warn(
            f"{self._fast_path_names[index]!r} ({type(module).__name__}) runs torch's slow "
            "path while an overlapped optimizer step is pending (its fused path needs no "
            "torch function mode on the stack): the same math, other rounding, padded "
            "positions not zeroed. For the fused path's bits, call "
            "wait_for_optimizer_step() on the optimizers with a pending step before this "
            "forward",
            stacklevel=2,
        )

    def _warn_if_forward_never_ended(self) -> None:
        """Owner modules ran on inputs needing grads since the last step, but the model's
        own forward never ended (the trainer calls another method of it, `model.encode`):
        the backward loads start only once that forward ends, so none ran. Said once."""
        if self._warned_no_forward_end or not (self._watch_inputs and self._watch.hooked):
            return
        self._warned_no_forward_end = True
        warnings.warn(
            "the modules under overlap_forward ran since the last step(), but its own "
            "forward (the model's __call__) did not end, and the backward loads "
            "(load_in_backward) start from its end: none ran. Call the model itself, or "
            "pass the module whose forward you call as overlap_forward",
            stacklevel=user_stacklevel(),
        )

    def _wait_for_read(self, chunk: int) -> None:
        """A torch call on the trainer's thread reads a param that lands with `chunk`, or
        (`chunk` past the last) a state home, which holds the update once written back."""
        self.warn_if_rank_local(chunk)
        if chunk >= len(self.chunk_done):
            # In the plan's first overlapped forward: the mode stays on in later ones, whose
            # hooks cannot wait for a whole step
            self._reads_outside_units |= self._tracing
            self.finish()
            if self.written_back is not None:
                self.written_back()
            return
        if self._tracing:  # the hooks wait for it from the next forward on
            self._reads_outside_units = True
            owner = self._reading_owner
            if owner < 0:
                self._start_chunk = max(self._start_chunk, chunk)
            elif chunk > self._module_chunk[owner]:
                self._module_chunk[owner] = chunk
                self._module_needs[owner] = max(self._module_needs[owner], self._chunk_needs[chunk])
        self.advance(self._ahead_of[chunk])
        self._wait_for_chunk(chunk, self._chunk_needs[chunk])

    def warn_if_rank_local(self, chunk: int) -> None:
        """A read outside the forward that enqueues chunks whose updates communicate: on a
        rank that reads alone (a log on rank 0), they wait for peers that are running
        their forward's collectives, and every rank hangs. Said once, before it can."""
        if (
            self._in_forward
            or self._reads.suspended_elsewhere()  # that thread runs the chunks
            or not self.runs_collectives
            or self._warned_rank_local_reads
            or self._pending is None
        ):
            return
        # what the read enqueues: its chunk's look-ahead, or (a state home) every chunk
        last = self._ahead_of[chunk] if chunk < len(self.chunk_done) else len(self.chunk_done)
        if self._enqueued > min(last, len(self.chunk_done) - 1):
            return
        self._warned_rank_local_reads = True
        warnings.warn(
            "a read of a param or optimizer state (or a backward) between step() and the "
            "next forward runs the pending step's chunks now, and their updates "
            "communicate (Muon's exchanges): every rank must make the same reads in the "
            "same order, or a read on one rank alone (a log of a weight on rank 0) hangs "
            "every rank. Call optimizer.wait_for_optimizer_step() on every rank before such "
            "reads",
            stacklevel=user_stacklevel(),
        )

    def _before_backward(self) -> None:
        """A backward adds into each existing `.grad` in place (autograd's AccumulateGrad,
        which no torch function mode sees): the chunks that still read such a grad land
        first. Outside a forward, its graph may be one retained from before `step()`,
        which saved params the step updates: every chunk lands, and autograd refuses such
        a graph as it does without overlap. Inside a forward (a gradient penalty), the
        graph is this forward's, whose params' chunks have landed: the rest of the step
        stays overlapped, and the first forward's look for reads goes on."""
        if not self._in_forward:
            self.warn_if_rank_local(len(self.chunk_done))
            self.finish()
            return
        chunk = max((c for p, c in self._param_chunk.items() if p.grad is not None), default=-1)
        if chunk > self._reads.landed:
            self.advance(self._ahead_of[chunk])
            self._wait_for_chunk(chunk, self._chunk_needs[chunk])

    def _before_state_dict(self, at_root: bool, prefix: str, keep_vars: bool) -> None:
        """`state_dict()` of a module of the model (a checkpoint): as `_before_load_state_dict`,
        and said where the step was interrupted inside a chunk (its params hold part of it:
        a checkpoint on Ctrl-C), as the optimizer's own `state_dict()` says: once a call,
        at the module it was called on (no prefix) or at the overlap's root (reached from
        a module above it, or given a prefix)."""
        message = self.interrupted() if self.interrupted is not None else None
        if message is not None and (at_root or not prefix):
            warnings.warn(
                f"state_dict() of the model returns params that are not a whole step's: {message}",
                stacklevel=user_stacklevel(),
            )
        self._before_load_state_dict()

    def _before_load_state_dict(self) -> None:
        """A module's `state_dict()` or `load_state_dict()` (a checkpoint, a rollback) reads
        or writes every param it covers while a step may be pending. The pending-read mode
        waits for each, but inside an FSDP2 forward it is off the stack, and a forward
        interrupted by a BaseException (Ctrl-C) runs no forward hook to end the step: the
        handler's checkpoint held weights from before the step, and its rollback was
        overwritten by the pending chunks. So the mode goes back on the trainer's stack
        until the step lands (inside a forward still running, the hooks still order the
        rest); on another thread, whose reads it does not see, the step lands now."""
        with self._advancing:  # not while another thread finishes the step
            # Inside the step's own chunk on this thread (a signal handler's checkpoint):
            # landing the step would re-enter it; the params are mid-update, as they are
            # when such a handler interrupts any optimizer's step.
            if not self._in_flight or self._reads.on_this_stack() or self._reads.suspended_here():
                return
            if self._in_forward and threading.get_ident() == self._step_thread:
                self._reads.reenter()
            else:
                self.warn_if_rank_local(len(self.chunk_done))
                self.finish()

    def _before_forward(self) -> None:
        if self._streams.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # A replay runs no hooks: it would read the params whatever the step had
            # enqueued by then, silently (torchtitan captures unless told not to).
            raise RuntimeError(
                "a CUDA graph is being captured over a forward of the model given as "
                "CPUOffloadOptimizer(overlap_forward=...): its replays would run without the "
                "hooks that make the forward wait for the pending step, and read weights "
                "whose update has not landed. Turn CUDA graphs off (torchtitan: "
                "--training.disable_cuda_graphs), or leave overlap_forward None"
            )
        self._reading_owner = -1
        self._in_forward = True
        grads = torch.is_grad_enabled()
        model = self._model()
        training = model is not None and model.training
        if grads:
            self._last_trained_in = training
        if not self._in_flight:
            self._reads.pop()  # still on this thread's stack if another thread finished
            return
        # Reads before this forward that landed chunks (a log of weights) leave its look
        # blind to reads of those chunks: only a forward none landed before can end it.
        # A read before every forward (a clamp, an EMA) would keep the mode on in all of
        # them: the look ends in the second such forward at the latest.
        look_may_end = self._reads.landed < 0 or self._blocked_looks >= 1
        self._blocked_looks += self._trace_reads and not look_may_end
        current = self._streams.current()
        if current != self._trainer_stream:
            # The forward runs on another stream than `step()` did: it becomes the
            # trainer's, ordered after what that one waited for (chunks marked landed).
            self._streams.wait(current, self._streams.mark(self._trainer_stream))
            self._trainer_stream = current
        if self._start_chunk >= 0:
            self.advance(self._ahead_of[self._start_chunk])
            self._wait_for_chunk(self._start_chunk, self._chunk_needs[self._start_chunk])
        if self._hooks_see_forward:
            self._tracing = self._trace_reads
            self._ends_look = grads and training == self._trains_in and look_may_end
            if not self._tracing and not self._reads_outside_units:
                self._reads.leave_stack()

    def _after_forward(self, args: Any, output: Any) -> None:
        # A forward that raised (torch calls this hook from its handler, with no output)
        # may not have reached the reads it was to find: the next one looks again. So
        # does the next after an evaluation (without grads, or in the other of train() and
        # eval() than the forward before the step), which may skip reads that only
        # training makes (a penalty term), and after a forward some chunks had landed
        # before (`_before_forward`).
        raised = output is None and sys.exc_info()[1] is not None
        self._in_forward = False
        if self._tracing and not raised and self._ends_look:
            self._trace_reads = False
        self._tracing = False
        if self._in_flight:
            self.finish()
        if self._watch.hooked:
            # Activation checkpointing reruns modules in the backward: watch this forward
            # only (a forward without grads, e.g. an evaluation, leaves the next one to it).
            self._watch_inputs = False
            self._watch.complete = True
            self._watch = _Watch()


class _PendingReads(TorchFunctionMode):
    """While a step is pending (pushed by `start`, popped by `finish`), torch calls on
    the trainer's thread that are given a param, a param's grad or a state tensor the step
    updates in place (a held `step` counter), a DTensor's local tensor among those, or the
    tensor such a view was taken of (a grad buffer), whose chunk has not landed on the
    trainer's stream wait for that chunk first; given a home of the offloaded state (a held
    `exp_avg`), for the whole step to be written back.

    Every torch call that may read data pays the look-up while the mode is on the stack,
    so it is kept short: a dict hit per argument (one level into lists), the rest only on
    a hit; metadata reads (`.shape`, `.device`) return before it.
    It sits at the bottom of the stack (above `torch.set_default_device`'s context, which
    must stay lowest), so a user's mode entered before `step()` and
    left after it still leaves its own context. The mode stack is per thread: `finish`
    from another thread only switches it off, and the thread that pushed it takes it off
    at its next push, pop or forward. While the step's chunks run (`suspended`), it is off
    for the thread running them only. Private API (`torch._C`'s torch function stack:
    `_len_torch_function_stack`, `_get_function_stack_at`, `_pop_torch_function_stack`,
    `_push_on_torch_function_stack`; torch 2.11 and 2.13).
    """

    def __init__(self, overlap: weakref.ref[ForwardOverlap]) -> None:
        super().__init__()
        self._overlap = overlap
        self.step_pending = False
        self.active = False  # off while the step itself runs (`suspended`: on its thread)
        self._suspended_by: int | None = None  # the thread running the step meanwhile
        self.chunk_of: dict[int, int] = {}  # id(param, grad, state tensor) -> its chunk
        self.shared_storages: dict[int, _StorageSpans] = {}  # `_shared_storage_spans`
        # id -> the grad or state tensor: one the trainer or the optimizer dropped is freed,
        # and a new tensor may take its id
        self._held: dict[int, weakref.ref[Tensor]] = {}
        self.landed = -1  # the last chunk the trainer's stream has waited for
        self._landing: list[list[int]] = []  # per chunk: the ids its landing forgets
        self._thread: int | None = None  # the thread whose stack holds this mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        # Metadata reads (`.device`, `.shape`) return first, untouched: traced by Dynamo
        # into a transformers Llama's forward (torch 2.13), what follows broke the graph
        # there and `inputs_embeds.device` came back as a `torch.Size`.
        # Compiled code passes through while another thread runs the step, as Dynamo
        # cannot trace `threading.get_ident` (torch 2.13), and a graph could not wait.
        if not self.active and (torch.compiler.is_compiling() or not self.suspended_elsewhere()):
            return func(*args, **kwargs)  # off, or the step's own reads and writes
        if not _touches_data(func):
            return func(*args, **kwargs)
        if func in _BACKWARDS:
            overlap = self._overlap()
            if overlap is not None:
                overlap._before_backward()
        else:
            # The look-up's own reads (`_base`, storage spans) would go through the modes
            # below this one (another overlapped optimizer's, the default device's): with
            # k pending, 2^k - 1 handler calls per torch call. Each mode sees the call
            # itself anyway, so they are read with torch functions off (not traced).
            if _depth() and not torch.compiler.is_compiling():
                with torch._C.DisableTorchFunction():
                    chunk = self._latest_read(args, kwargs)
            else:
                chunk = self._latest_read(args, kwargs)
            if chunk > self.landed:
                overlap = self._overlap()
                if overlap is not None:
                    overlap._wait_for_read(chunk)
        return func(*args, **kwargs)

    def _latest_read(self, args: tuple, kwargs: dict) -> int:
        """The latest pending chunk that a torch call given `args` and `kwargs` reads."""
        values = (*args, *kwargs.values()) if kwargs else args
        if torch.compiler.is_compiling():
            values = _instances_among(values, _COMPILED_LOOKS_UP)
        chunk = _latest_chunk(self.chunk_of, self._held, values)
        if self.shared_storages and not torch.compiler.is_compiling():
            chunk = max(chunk, _latest_in_shared_storage(self.shared_storages, values))
        if torch._C._are_functorch_transforms_active():  # see `_unwrapped`
            unwrapped = _unwrapped((*args, *kwargs.values()))
            chunk = max(chunk, _latest_chunk(self.chunk_of, self._held, unwrapped))
            if self.shared_storages:
                chunk = max(chunk, _latest_in_shared_storage(self.shared_storages, unwrapped))
        return chunk

    def suspended_here(self) -> bool:
        """This thread runs the step's chunks now (a call from inside one)."""
        return self._suspended_by == threading.get_ident()

    def suspended_elsewhere(self) -> bool:
        """Another thread runs the step's chunks now (this one's reads wait for it)."""
        return self._suspended_by is not None and self._suspended_by != threading.get_ident()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Off for the step's own reads and writes, on the thread that runs it (under the
        overlap's lock); another thread's reads meanwhile still wait, for that lock."""
        saved = self.active, self._suspended_by
        self.active, self._suspended_by = False, threading.get_ident()
        try:
            yield
        finally:
            self.active, self._suspended_by = saved

    def push(
        self,
        overlap: ForwardOverlap,
        state_scalars: Mapping[Tensor, Sequence[Tensor]],
        state_homes: Collection[Tensor],
    ) -> None:
        """On, for `overlap`'s pending step: at the bottom of this thread's stack (above the
        default device's context)."""
        self._remove()
        self.chunk_of = {id(p): c for p, c in overlap._param_chunk.items()}
        self.shared_storages = overlap._shared_storages
        held = [(p.grad, c) for p, c in overlap._param_chunk.items() if p.grad is not None]
        held += [(t, c) for p, c in overlap._param_chunk.items() for t in state_scalars.get(p, ())]
        # FSDP2's shard buffers: an `unshard()` by hand between `step()` and the forward
        # (to export or average weights) reads them
        # (asked at each step: FSDP2's lazy init and `reset_sharded_param` make them anew)
        buffers = {p: b for unit in overlap._units for p, b in fsdp_shard_buffers(unit).items()}
        held += [
            (buffer, c)
            for p, c in overlap._param_chunk.items()
            if (buffer := buffers.get(p)) is not None
        ]
        # A DTensor's `to_local()` / `full_tensor()` read its local tensor, not the DTensor.
        held += [
            (local, c)
            for t, c in itertools.chain(overlap._param_chunk.items(), held)
            if (local := dtensor_local(t)) is not None
        ]
        # Grads that are views of one buffer (Megatron's, zeroed through it before the
        # forward): a call given the buffer waits for the last chunk reading any of them.
        bases: dict[Tensor, int] = {}
        for t, c in itertools.chain(overlap._param_chunk.items(), held):
            if t._base is not None:
                bases[t._base] = max(c, bases.get(t._base, -1))
        held += bases.items()
        for t, c in held:
            self.chunk_of[id(t)] = max(c, self.chunk_of.get(id(t), -1))
        self._held = {id(t): weakref.ref(t) for t, _ in held}
        # What each chunk's landing forgets: nothing waits for it any more, and a weak
        # reference to a grad blocks `torch.utils.swap_tensors` (`model.to()` swapping).
        self._landing: list[list[int]] = [[] for _ in overlap.chunk_done]
        for i, c in self.chunk_of.items():
            self._landing[c].append(i)
        # Past the last chunk: the whole step, home. The homes live as long as the
        # optimizer, so their ids are not checked (`_held`): torch 2.11's Dynamo, tracing
        # this mode in a compiled forward, fails to fake the slab views it would find there.
        written_back = len(overlap.chunk_done)
        homes = [*state_homes, *(dtensor_local(t) for t in state_homes)]
        self.chunk_of |= {id(t): written_back for t in homes if t is not None}
        self.step_pending, self.landed = True, -1
        self._stack()

    def reenter(self) -> None:
        """Back on, on this thread's stack, while the step is pending (after `leave_stack`)."""
        if self.step_pending and not self.active:
            self._remove()  # where it was left an orphan, say
            self._stack()

    def _stack(self) -> None:
        """On, at the bottom of this thread's stack."""
        self.active = True
        modes = _function_modes()
        # Under `torch.set_default_device`'s context, which must stay at the very bottom
        # (`set_default_device(None)` asserts so on leaving it); not under a `with
        # torch.device(...)` block's, whose exit pops the top mode, whatever it is.
        # Private API (`torch._GLOBAL_DEVICE_CONTEXT`; torch 2.11, 2.13).
        default = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
        bottom = 1 if modes and default is not None and modes[0] is default else 0
        _restack([*modes[:bottom], self, *modes[bottom:]])
        self._thread = threading.get_ident()

    def landed_through(self, chunk: int) -> None:
        """The trainer's stream has waited for the chunks up to `chunk`."""
        for c in range(self.landed + 1, chunk + 1):
            for i in self._landing[c]:
                self.chunk_of.pop(i, None)
                self._held.pop(i, None)
        self.landed = max(self.landed, chunk)

    def on_this_stack(self) -> bool:
        """On, and on the calling thread's stack."""
        return self.active and self._thread == threading.get_ident()

    def pop(self) -> None:
        """Off, the step landed; taken off the stack where this thread holds it."""
        self._switch_off()
        self._remove()

    def pop_in_finalizer(self) -> None:
        """`pop` from the finalizer (or `close`). Where it runs inside torch's function
        dispatch (a collection may run there, as between `handle_torch_function`'s check
        that a mode is on the stack and its pop of it, which then raised), off now, and off
        the stack at the next module call on its thread (`_orphan`)."""
        self._switch_off()
        if not _among_callers("torch.overrides"):
            self._remove()
        elif self._thread is not None:
            _orphan(self._thread, [self])

    def _switch_off(self) -> None:
        self.active, self.step_pending, self.chunk_of, self._held = False, False, {}, {}
        self.shared_storages = {}

    def leave_stack(self) -> None:
        """Off the stack while the step is still pending (the hooks see every read)."""
        self.active = False
        self._remove()

    def _remove(self) -> None:
        """Take this mode, and this thread's orphans, off this thread's stack.

        A finalizer may run on any thread, and inside a mode's own `__torch_function__`
        (torch takes the mode off the stack while it runs, and puts it back after): a mode
        not found where it was pushed becomes an orphan, taken off by the next push or pop
        of any pending-read mode on its thread.
        """
        here = threading.get_ident()
        if self._thread is not None and self._thread != here:
            _orphan(self._thread, [self])
            return
        with _ORPHANS_LOCK:
            orphans = _ORPHANS.pop(here, ())
        _take_off_stack([self, *(mode for mode in orphans if mode is not self)], here)


def _take_off_stack(leaving: list[_PendingReads], here: int, keep_late: bool = True) -> None:
    """Take `leaving` off this thread's stack; with `keep_late`, those not on it (inside
    their own dispatch, which torch takes them off for) stay orphans of this thread."""
    ids = {id(mode) for mode in leaving}
    modes = _function_modes()
    found = {id(mode) for mode in modes if id(mode) in ids}
    _restack([mode for mode in modes if id(mode) not in ids])
    late = [m for m in leaving if id(m) not in found and m._thread == here and keep_late]
    for mode in leaving:
        if mode not in late:
            mode._thread = None
    if late:
        _orphan(here, late)


def _among_callers(module: str) -> bool:
    """Whether code of `module` (or a module inside it) is among the callers."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == module or name.startswith(module + "."):
            return True
        frame = frame.f_back
    return False


def _orphan(thread: int, modes: list[_PendingReads]) -> None:
    """`modes`, switched off, are to come off `thread`'s stack: by the next push or pop of
    a pending-read mode there, or by the next module call there (a global forward
    pre-hook, held while any thread has orphans: a wrapper closed or collected on
    another thread has no hooks of its own left to do it)."""
    global _DRAIN_HOOK
    with _ORPHANS_LOCK:
        orphans = _ORPHANS.setdefault(thread, [])
        orphans += [m for m in modes if not any(m is o for o in orphans)]  # once each
        if _DRAIN_HOOK is None:
            _DRAIN_HOOK = nn.modules.module.register_module_forward_pre_hook(_drain_orphans)


def _drain_orphans(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_compiling():  # traced by Dynamo: the next eager call drains
        return
    here = threading.get_ident()
    global _DRAIN_HOOK
    with _ORPHANS_LOCK:
        orphans = _ORPHANS.pop(here, [])
        # A thread that ended took its stack with it (and its id may be taken again).
        alive = {thread.ident for thread in threading.enumerate()}
        for ended in [t for t in _ORPHANS if t not in alive]:
            del _ORPHANS[ended]
        if not _ORPHANS and _DRAIN_HOOK is not None:
            _DRAIN_HOOK.remove()
            _DRAIN_HOOK = None
    # A module call is outside any mode's dispatch: what is not on the stack is gone.
    _take_off_stack(orphans, here, keep_late=False)


_ORPHANS: dict[int, list[_PendingReads]] = {}
"""Per thread, pending-read modes switched off where they could not be taken off its stack."""
_ORPHANS_LOCK = threading.RLock()  # a collection inside it may run another finalizer
_DRAIN_HOOK: RemovableHandle | None = None


def _outside_transforms() -> contextlib.AbstractContextManager[None]:
    """torch.func's transforms (grad, vmap) off: the step's copies and updates act on the
    optimizer's own tensors, which a transform running the forward or backward would
    take for captured tensors mutated in place, and refuse. Private API
    (`torch._C._DisableFuncTorch`, which FSDP2 uses around its own copies; torch 2.11, 2.13)."""
    return torch._C._DisableFuncTorch()


@contextlib.contextmanager
def _unrecorded() -> Iterator[None]:
    """The JIT tracer and the dispatch modes off: the step's ops are not the forward's.
    Run from a forward, `torch.jit.trace` recorded the update into the traced module
    (each call re-applied it), selective activation checkpointing cached
    Newton-Schulz's products as the block's activations (its recompute then took them for
    the block's, and failed or trained on wrong grads), `FlopCounterMode` counted them.
    Without either on (the usual forward), it costs three counter reads, not the 7 us of
    setting them aside. Private API (`torch._C._get_tracing_state` / `_set_tracing_state`,
    `_len_torch_dispatch_stack`, `torch._ops._len_torch_dispatch_stack_pre_dispatch`,
    `torch.utils._python_dispatch._disable_current_modes`; torch 2.11, 2.13)."""
    tracing = torch._C._get_tracing_state()
    if (
        tracing is None
        and torch._C._len_torch_dispatch_stack() == 0
        and torch._ops._len_torch_dispatch_stack_pre_dispatch() == 0
    ):
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes():
            yield
    finally:
        torch._C._set_tracing_state(tracing)


def _function_modes() -> tuple[Any, ...]:
    """This thread's torch function modes, bottom first."""
    return tuple(torch._C._get_function_stack_at(i) for i in range(_depth()))


def _restack(modes: Sequence[Any]) -> None:
    """This thread's torch function mode stack made `modes`, bottom first. Private API
    (`torch._C`'s torch function stack; torch 2.11, 2.13), as in `_PendingReads`."""
    for _ in range(_depth()):
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def _function_modes_kept(kept: Collection[Any]) -> Iterator[None]:
    """Of this thread's torch function modes, only those among `kept` on, in their order,
    and all of them back after. A mode entered around the forward (an op logger, or this
    module's pending-read mode) would otherwise see the update's ops as the forward's; a
    mode that was on at `step()` as well (`torch.set_default_device`'s) makes the update
    as `step()` would have. Private API (`torch._C`'s torch function stack; torch 2.11,
    2.13), through `_restack`."""
    if _depth() == 0:
        yield
        return
    keep = {id(mode) for mode in kept}
    modes = _function_modes()
    _restack([mode for mode in modes if id(mode) in keep])
    try:
        yield
    finally:
        # a kept mode taken off meanwhile (a finalizer's `_remove`) stays off
        still = {id(mode) for mode in _function_modes()}
        _restack([mode for mode in modes if id(mode) not in keep or id(mode) in still])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype, thread: int | None) -> Iterator[None]:
    """torch's default dtype set to `dtype` (what `step()` saw: the step's new state,
    AdamW's `step` counters say, takes it), and back after; on `thread` (the one that
    called `step()`) only: the setting is the process's, and another thread waiting for
    the step would switch it under the trainer's feet."""
    now = torch.get_default_dtype()
    if now == dtype or threading.get_ident() != thread:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(now)


def _depth() -> int:
    return torch._C._len_torch_function_stack()


_COMPILED_LOOKS_UP = (
    torch.nn.Parameter
    if tuple(map(int, re.findall(r"\d+", torch.__version__)[:2])) < (2, 13)
    else torch.Tensor
)
"""What compiled code looks up. Dynamo before torch 2.13 traces `id()` of neither a
constant (an int argument) nor a tensor made in the graph: a block compiled with
fullgraph=True raised at its first call while a step was pending (torch 2.11), so there
only params are looked up (what the graph reads of the step's: views of params held across
the step, and grads and state, are not waited for there). Torch 2.13 traces both, but not
`id()` of a `torch.device` argument under a `with torch.device(...)` entered before
`step()` (Dynamo's guard on the mode stack fails with a NameError): only tensors."""


def _group_up() -> bool:
    """A default process group is up."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _instances_among(values: Iterable[Any], kind: type) -> list[Any]:
    """The instances of `kind` among `values`, one level into lists and tuples (as
    `_latest_chunk`)."""
    found = []
    for value in values:
        items = value if isinstance(value, (list, tuple)) else (value,)
        found.extend(item for item in items if isinstance(item, kind))
    return found


def _latest_chunk(
    chunk_of: dict[int, int], held: dict[int, weakref.ref[Tensor]], values: Iterable[Any]
) -> int:
    """The latest chunk among the params, grads and state tensors in `values` (one level
    into lists and tuples, their subclasses too), or views of them (made before the step
    and held across it), else -1. A hit on a grad's or state tensor's id is checked to be
    that tensor (ids of freed tensors are reused). On the trainer's path for each torch
    call, a list of numbers too (`torch.tensor(batch)`): written out for both shapes of
    argument, without nested lists (8 x 4096 token ids: 0.5 us, not 0.9)."""
    latest = -1
    for value in values:
        if isinstance(value, (list, tuple)):
            for item in value:
                chunk = chunk_of.get(id(item), -1)
                if chunk < 0:
                    base = getattr(item, "_base", None)
                    if base is None:
                        continue
                    item, chunk = base, chunk_of.get(id(base), -1)
                if chunk > latest and _is_it(held, item):
                    latest = chunk
        else:
            chunk = chunk_of.get(id(value), -1)
            if chunk < 0:
                base = getattr(value, "_base", None)
                if base is None:
                    continue
                value, chunk = base, chunk_of.get(id(base), -1)
            if chunk > latest and _is_it(held, value):
                latest = chunk
    return latest


class _StorageSpans(NamedTuple):
    """The params in one storage, by byte span sorted by start, and the longest span."""

    starts: list[int]
    spans: list[tuple[int, int, int]]  # (start, end, chunk)
    longest: int


def _byte_span(t: Tensor) -> tuple[int, int]:
    """The bytes of its storage `t` may read (strides non-negative, as params' are)."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() * size, (t.storage_offset() + extent) * size


def _shared_storage_spans(param_chunk: Mapping[Tensor, int]) -> dict[int, _StorageSpans]:
    """By storage address: the plain params in a storage that holds more than one param
    or more than its param, as when params are laid out in one flat buffer
    (`p.data = flat[a:b].view_as(p)`, apex's and DeepSpeed's way). No id names such a
    buffer, nor a `.data` alias of it: a call given a tensor in that storage waits for
    the chunks of the params its bytes meet (`_latest_in_shared_storage`). Other models
    have none, and their calls pay one check of an empty dict."""
    by_storage: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}
    for p, chunk in param_chunk.items():
        if type(p) not in (Tensor, nn.Parameter) or p.numel() == 0:
            continue  # a DTensor's shards are FSDP2's own (`fsdp_shard_buffers`)
        storage = p.untyped_storage()
        if storage.data_ptr() == 0:
            continue
        entry = by_storage.setdefault(storage.data_ptr(), (storage.nbytes(), []))
        entry[1].append((*_byte_span(p), chunk))
    shared = {}
    for address, (nbytes, spans) in by_storage.items():
        if len(spans) > 1 or spans[0][1] - spans[0][0] < nbytes:
            spans.sort()
            longest = max(end - start for start, end, _ in spans)
            shared[address] = _StorageSpans([start for start, _, _ in spans], spans, longest)
    return shared


def _latest_in_shared_storage(shared: dict[int, _StorageSpans], values: Iterable[Any]) -> int:
    """The latest chunk of the params whose bytes the tensors among `values` (one level
    into lists and tuples) meet in a storage of `shared`, else -1."""
    latest = -1
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if type(item) not in (Tensor, nn.Parameter) or item.layout != torch.strided:
                continue
            try:
                address = item.untyped_storage().data_ptr()
            except RuntimeError:  # no storage: torch.func's wrappers (`_unwrapped` looks)
                continue
            spans = shared.get(address)
            if spans is None or item.numel() == 0:
                continue
            start, end = _byte_span(item)
            at = bisect.bisect_left(spans.starts, start - spans.longest + 1)
            for first, last, chunk in spans.spans[at:]:
                if first >= end:
                    break
                if last > start and chunk > latest:
                    latest = chunk
    return latest


def _unwrapped(values: Iterable[Any]) -> list[Tensor]:
    """The tensors torch.func's transforms wrapped among `values` (one level into lists and
    tuples, as `_latest_chunk` looks), unwrapped: `vmap(f)(param)` hands `f` a batched
    tensor around the param. Private API
    (`torch._C._functorch`'s `is_functorch_wrapped_tensor`, `get_unwrapped`, and
    `torch._C._are_functorch_transforms_active`; torch 2.11, 2.13)."""
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor

    found = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, Tensor) and is_functorch_wrapped_tensor(item):
                while is_functorch_wrapped_tensor(item):
                    item = get_unwrapped(item)
                found.append(item)
    return found


def _is_it(held: dict[int, weakref.ref[Tensor]], value: Any) -> bool:
    """`value` is the param, grad or state tensor its id was recorded for."""
    recorded = held.get(id(value))
    return recorded is None or recorded() is value


_METADATA = frozenset(
    (
        *("grad", "_grad", "grad_fn", "requires_grad", "requires_grad_", "is_leaf"),
        *("register_hook", "register_post_accumulate_grad_hook", "retain_grad"),
        *("shape", "size", "dtype", "device", "layout", "ndim", "dim", "numel", "nelement"),
        *("stride", "storage_offset", "is_contiguous", "element_size", "data_ptr"),
        *("is_cuda", "is_sparse", "is_meta", "is_floating_point", "is_complex", "get_device"),
        *("__len__", "names"),
    )
)
"""Tensor attributes and methods that read or set no param values."""


_FAST_PATH_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerEncoder)
"""torch's modules whose own forward takes a fused path only when `has_torch_function` finds
no mode on the stack (torch 2.11, 2.13); a subclass overriding `forward` is not among them."""


def _fast_path_modules(model: nn.Module) -> list[nn.Module]:
    """`model`'s modules running the forward of one of `_FAST_PATH_MODULES`, but those in a
    compiled module (`torch.compile(layer)`, as torchtitan compiles its blocks): a hook
    there breaks the block's full graph. Private API (`torch._dynamo`'s `OptimizedModule`,
    torch 2.11 and 2.13; where Dynamo was never imported, nothing is compiled)."""
    dynamo = sys.modules.get("torch._dynamo")
    compiled = dynamo.eval_frame.OptimizedModule if dynamo is not None else ()
    found, seen, todo = [], set(), [model]
    while todo:
        module = todo.pop()
        if module in seen or isinstance(module, compiled):
            continue
        seen.add(module)
        if isinstance(module, _FAST_PATH_MODULES) and any(
            type(module).forward is cls.forward for cls in _FAST_PATH_MODULES
        ):
            found.append(module)
        todo += reversed(list(module.children()))
    return found


# What runs a backward (through a graph that may have saved params).
_BACKWARDS = (Tensor.backward, torch.autograd.backward, torch.autograd.grad)


def _touches_data(func: Callable[..., Any]) -> bool:
    if func is torch.autograd.grad:  # named as the `.grad` attribute
        return True
    name = func.__name__
    if name in ("__get__", "__set__", "__delete__"):  # a property: named by its descriptor
        name = getattr(func.__self__, "__name__", name)
    return name not in _METADATA


def _first_grad_tensor(values: Iterable[Any]) -> Tensor | None:
    """The first tensor in `values` that the backward computes a grad for, else None; not a
    leaf (a param passed as an input): a hook on a leaf outlives the backward, and one a
    step would pile up on it."""
    for value in values:
        if isinstance(value, Tensor) and value.requires_grad and value.grad_fn is not None:
            return value
    return None


class _Watch:
    """One forward's hooks on its owner modules' inputs: how many, and whether that
    forward ran to its end (a hook of one that raised midway reports nothing)."""

    def __init__(self) -> None:
        self.hooked = 0
        self.complete = False


def _backward_reached_hook(
    overlap: weakref.ref[ForwardOverlap], watch: _Watch
) -> Callable[[Tensor], None]:
    index = watch.hooked  # in forward order: the backward passes them last first

    def hook(grad: Tensor) -> None:
        target = overlap()
        if watch.complete and target is not None and target.backward_reached is not None:
            with _outside_transforms():  # a backward inside torch.func.grad
                target.backward_reached(watch.hooked - index, watch.hooked)

    return hook


FULLGRAPH_HOOK_REASON = (
    "CPUOffloadOptimizer(overlap_forward=...) hooks the modules holding the optimizer's "
    "params (FSDP2 units; in a plain model, each param's module) to wait for the pending "
    "step, and the hooks run eagerly. Under fullgraph=True, compile FSDP2 units before "
    "fully_shard, as torchtitan does (their hooks then run outside the graph); otherwise "
    "compile without fullgraph=True, or leave overlap_forward unset"
)


class _OverlapHook:
    """A module hook calling `method` of the overlap while it lives (with the hook's
    `args` and `kwargs` where `with_inputs`). A copy or a pickle of the model (an EMA
    copy, `torch.save(model)`) gets an `_InertHook`: the copy's forward must not drive
    this optimizer's step, and a weak reference does not pickle."""

    def __init__(
        self, overlap: weakref.ref[ForwardOverlap], method: str, *bound: Any, with_inputs: bool
    ) -> None:
        self._overlap, self._method, self._bound = overlap, method, bound
        self._with_inputs = with_inputs

    # Compiled forwards run the hooks eagerly: traced, the optimizer's step would
    # become part of the user's graph (and recompile as chunks advance). The reason is
    # what fullgraph=True's error shows the user.
    @torch.compiler.disable(reason=FULLGRAPH_HOOK_REASON)
    def __call__(self, module: nn.Module, args: Any, *rest: Any) -> None:
        target = self._overlap()
        if target is not None:
            inputs = (args, *rest) if self._with_inputs else ()
            getattr(target, self._method)(*self._bound, *inputs)

    def __reduce__(self) -> tuple[type[_InertHook], tuple[()]]:
        return _InertHook, ()


class _InertHook:
    """What a copied or unpickled model holds in place of an `_OverlapHook`."""

    def __call__(self, *args: Any) -> None:
        return None


def _register_hooks(
    model: nn.Module,
    owners: list[tuple[nn.Module, list[Tensor]]],
    fast_path: list[nn.Module],
    overlap: weakref.ref[ForwardOverlap],
) -> list[RemovableHandle]:
    """A pre-hook on each owner module (prepended: before FSDP2's unshard) and each
    `fast_path` module, a pre-hook and a forward hook (also called when the forward
    raises an Exception) on the model, and state-dict and load pre-hooks on every module,
    calling into `overlap` while it lives."""
    handles: list[RemovableHandle] = []
    hooked = [
        (module, _OverlapHook(overlap, "_before_module", i, with_inputs=True))
        for i, (module, _) in enumerate(owners)
    ]
    try:
        for module, hook in hooked:
            handles.append(module.register_forward_pre_hook(hook, prepend=True, with_kwargs=True))
        for i, module in enumerate(fast_path):
            hook = _OverlapHook(overlap, "_before_fast_path", i, with_inputs=False)
            handles.append(module.register_forward_pre_hook(hook))
        before = _OverlapHook(overlap, "_before_forward", with_inputs=False)
        after = _OverlapHook(overlap, "_after_forward", with_inputs=True)
        module = model
        handles.append(model.register_forward_pre_hook(before, prepend=True))
        handles.append(model.register_forward_hook(after, always_call=True))
        # on every module: `state_dict()` may be called on any of them
        load = _OverlapHook(overlap, "_before_load_state_dict", with_inputs=False)
        for module in model.modules():
            at_root = module is model
            state_dict = _OverlapHook(overlap, "_before_state_dict", at_root, with_inputs=True)
            handles.append(module.register_state_dict_pre_hook(state_dict))
            handles.append(module.register_load_state_dict_pre_hook(load))
    except RuntimeError as error:  # a torch.jit.script-ed module takes no hooks
        for handle in handles:
            handle.remove()
        name = next((n for n, m in model.named_modules() if m is module), "")
        raise RuntimeError(
            f"overlap_forward hooks every module that reads the optimizer's params, and "
            f"module {name or '(the root)'!r} ({type(module).__name__}) takes no hooks: "
            f"{error}. Keep that module eager (not torch.jit.script-ed), or leave "
            "overlap_forward None"
        ) from error
    return handles


def _remove(
    handles: list[RemovableHandle],
    reads: _PendingReads,
    dropped_pending: Sequence[Callable[[], None]],
) -> None:
    for handle in handles:
        handle.remove()
    if reads.step_pending:  # the optimizer was dropped (collected) with a step pending
        warnings.warn(
            "a CPUOffloadOptimizer with forward overlap was collected with a step pending: "
            "the chunks that had run updated their params, but their state never went "
            "home, and the others never ran, so params and state disagree; the wrapped "
            "optimizer refuses to step until load_state_dict. Call "
            "wait_for_optimizer_step() or close() before dropping it",
            RuntimeWarning,
            stacklevel=2,
        )
        for dropped in dropped_pending:
            dropped()
    reads.pop_in_finalizer()


def user_stacklevel() -> int:
    """The `warnings.warn` stacklevel, called from a warning's site, that points at
    the first caller outside this library and torch (the user's `step()` call)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in (
        "offload",
        "muon",
        "muon_offload",
        "torch",
    ):
        level, frame = level + 1, frame.f_back
    return level
