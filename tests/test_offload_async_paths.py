"""The offloaded step's asynchronous branches (`CopyStreams.async_copies`, taken on CUDA)
run on the CPU with Python stand-ins for streams and events: CI runs the code a GPU runs
(its stream contexts, event records and waits, `record_stream` calls), bitwise equal to
the plain optimizer, and checks that each wait the order relies on waits for the record it
needs. On CUDA a wait sees an event's latest record: one never recorded waits for nothing,
and one whose record was skipped waits for an earlier step's work. So an update must wait
for a load record no other update waited for, a write-back for an update record no other
write-back waited for, and the forward for an update recorded by the step now pending."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from spawn_ranks import one_rank_group
from test_offload_audit import assert_equal

import offload.executor
import offload.forward_overlap
import offload.streams
from offload import CPUOffloadOptimizer
from offload.forward_overlap import ForwardOverlap


@dataclass
class _Wait:
    event: _Event
    record: int  # the event's records so far
    record_step: int  # the overlapped step its latest record was made in
    step: int  # the overlapped step pending at the wait
    stream: _Stream  # the stream that waits


_STEPS = [0]  # overlapped steps started
_WAITS: list[_Wait] = []


class _Stream:
    def __init__(self, device: torch.device | None = None) -> None:
        pass

    def wait_event(self, event: _Event) -> None:
        assert isinstance(event, _Event), event
        _WAITS.append(_Wait(event, event.records, event.step, _STEPS[0], self))


class _Event:
    def __init__(self, device: torch.device | None = None) -> None:
        self.records = 0
        self.step = -1
        self.stream: _Stream | None = None  # the stream of its latest record

    def record(self, stream: _Stream) -> None:
        assert isinstance(stream, _Stream), stream
        self.records += 1
        self.step = _STEPS[0]
        self.stream = stream

    def synchronize(self) -> None:
        pass


@pytest.fixture
def async_branches(monkeypatch):
    """Streams and events as `_Stream` and `_Event`, and the copy pipeline taking its
    asynchronous branches on the CPU."""
    current = threading.local()
    default = _Stream()
    real_init = offload.streams.CopyStreams.__init__

    def init(self, device: torch.device, slots: int) -> None:
        real_init(self, device, 0)
        self.async_copies = True
        self.h2d, self.d2h = self.new_stream(), self.new_stream()
        self.ensure_slots(slots)

    def set_stream(stream: _Stream) -> None:
        assert isinstance(stream, _Stream), stream
        current.stream = stream

    def record_stream(tensor: torch.Tensor, stream: _Stream) -> None:
        assert isinstance(stream, _Stream), stream

    monkeypatch.setattr(offload.streams.CopyStreams, "__init__", init)
    monkeypatch.setattr(torch, "Stream", _Stream)
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(
        torch.accelerator, "current_stream", lambda device=None: getattr(current, "stream", default)
    )
    monkeypatch.setattr(torch.accelerator, "set_stream", set_stream)
    real_start = ForwardOverlap.start

    def start(self, *args, **kwargs) -> None:
        _STEPS[0] += 1
        real_start(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    monkeypatch.setattr(ForwardOverlap, "start", start)
    _WAITS.clear()
    yield lambda: getattr(current, "stream", default) is default
    _WAITS.clear()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Embedding(40, 16)]
    for _ in range(4):
        layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 5))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"overlap": True},
        {"overlap": True, "load_in_backward": True},
        {"overlap": True, "gpu_resident_bytes": 6000},
        {"gpu_resident_bytes": "auto"},
        {"overlap": True, "gpu_resident_bytes": "auto"},
    ],
    ids=["plain", "overlap", "backward_loads", "resident", "auto", "overlap_auto"],
)
def test_the_asynchronous_branches_are_bitwise_equal_and_wait_for_recorded_events(
    options, async_branches
):
    options = dict(options)
    plain_model, model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    overlap = options.pop("overlap", False)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=512,
        staging_slots=2,
        overlap_forward=model if overlap else None,
        **options,
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        tokens = torch.randint(0, 40, (3, 4), generator=gen)
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            m(tokens).square().mean().backward()
            o.step()
    assert_equal(plain_model, plain, model, opt)
    streams = opt._streams
    consumed = {id(e) for e in [*streams.loaded, *streams.stepped]}  # one wait per record
    waits = [w for w in _WAITS if id(w.event) in consumed]
    assert waits and all(w.record > 0 for w in waits)
    assert len({(id(w.event), w.record) for w in waits}) == len(waits)
    if overlap:
        done = {id(e) for e in opt._overlap.chunk_done}
        waits = [w for w in _WAITS if id(w.event) in done]
        assert waits and all(w.record > 0 and w.record_step == w.step for w in waits)
    assert async_branches()  # the trainer's stream is current again
    opt.close()


def _overlapped(model: torch.nn.Module, chunk_bytes: int = 512) -> CPUOffloadOptimizer:
    """AdamW on `model` with forward overlap, a ring of 2."""
    return CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=chunk_bytes,
        staging_slots=2,
        overlap_forward=model,
    )


def _pending_step(model: torch.nn.Module) -> CPUOffloadOptimizer:
    """AdamW on `model` with overlap, its second step pending."""
    opt = _overlapped(model)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 40, (3, 4), generator=gen)).square().mean().backward()
        opt.step()
    return opt


def _waited_for(stream: _Stream, event: _Event) -> bool:
    """`stream` waited for `event`'s record in the step now pending."""
    return any(
        w.stream is stream and w.event is event and w.record_step == w.step == _STEPS[0]
        for w in _WAITS
    )


def test_a_read_on_another_stream_leaves_the_trainers_stream_to_wait_for_itself(
    async_branches,
):
    """A read on another stream (an EMA on a side stream) waits there; the trainer's
    stream, reading the param where no hook sees it (a tied or functional read), still
    waits for its update."""
    model = _model()
    opt = _pending_step(model)
    head = model[-1].weight
    done = opt._overlap.chunk_done[opt._overlap._param_chunk[head]]
    trainer, side = torch.accelerator.current_stream(), torch.Stream()
    torch.accelerator.set_stream(side)
    torch.mul(head, 1.0)
    torch.accelerator.set_stream(trainer)
    assert _waited_for(side, done) and not _waited_for(trainer, done)
    torch.add(head, 0.0)
    assert _waited_for(trainer, done)
    opt.close()


def test_a_step_finished_on_another_stream_makes_the_trainers_stream_wait(async_branches):
    """`zero_grad(set_to_none=False)` under another stream finishes the pending step there;
    nothing waits for reads after that, so the trainer's stream waits for the last update
    too."""
    model = _model()
    opt = _pending_step(model)
    last = opt._overlap.chunk_done[-1]
    trainer, side = torch.accelerator.current_stream(), torch.Stream()
    torch.accelerator.set_stream(side)
    opt.zero_grad(set_to_none=False)
    torch.accelerator.set_stream(trainer)
    assert _waited_for(side, last) and _waited_for(trainer, last)
    opt.close()


def _train_on_streams(model, opt, batches, step_stream=None, forward_stream=None) -> None:
    """Iterations with the forward and backward on `forward_stream` and `step()` on
    `step_stream` (None: the default stream)."""
    default = torch.accelerator.current_stream()
    for batch in batches:
        opt.zero_grad()
        torch.accelerator.set_stream(forward_stream or default)
        model(batch).square().mean().backward()
        torch.accelerator.set_stream(step_stream or default)
        opt.step()
        torch.accelerator.set_stream(default)
    if isinstance(opt, CPUOffloadOptimizer):
        opt.wait_for_optimizer_step()


@pytest.mark.parametrize("where", ["step", "forward"])
def test_a_forward_on_another_stream_than_step_becomes_the_trainers_stream(
    async_branches, monkeypatch, where
):
    """`step()` on one stream and the forward on another: the forward's stream takes over
    as the trainer's (after the first's waits), so its hooks' waits mark chunks landed and
    the reads they cover cost the mode nothing, as on one stream; bitwise equal."""
    reads = []
    wait_for_read = ForwardOverlap._wait_for_read
    monkeypatch.setattr(
        ForwardOverlap, "_wait_for_read", lambda self, c: reads.append(c) or wait_for_read(self, c)
    )
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 40, (3, 4), generator=gen) for _ in range(4)]
    default, counts = torch.accelerator.current_stream(), []
    for side in (None, torch.Stream()):
        plain_model, model = _model(), _model()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        opt = _overlapped(model)
        reads.clear()
        on = {"step_stream": side} if where == "step" else {"forward_stream": side}
        _train_on_streams(model, opt, batches, **on)
        counts.append(len(reads))
        _train_on_streams(plain_model, plain, batches)
        assert_equal(plain_model, plain, model, opt)
        opt.close()
    assert counts == [0, 0]  # the hooks cover every read of this model
    # the forward's stream waited for a mark of the one `step()` ran on
    forward, step = (default, side) if where == "step" else (side, default)
    assert any(w.stream is forward and w.event.stream is step for w in _WAITS)


def test_a_forward_on_another_stream_ends_the_step_for_the_steps_stream_too(async_branches):
    """An evaluation forward on another stream while a step is pending finishes the step
    there: the stream `step()` ran on, where training goes on, waits for the last update
    too (nothing waits for reads after that)."""
    model = _model()
    opt = _pending_step(model)
    last = opt._overlap.chunk_done[-1]
    trainer, side = torch.accelerator.current_stream(), torch.Stream()
    torch.accelerator.set_stream(side)
    with torch.no_grad():
        model(torch.randint(0, 40, (3, 4)))
    torch.accelerator.set_stream(trainer)
    assert _waited_for(side, last) and _waited_for(trainer, last)
    opt.close()


@pytest.mark.parametrize("where", ["step", "forward"])
def test_fsdp2_prefetch_with_the_forward_on_another_stream_than_step(async_branches, where):
    """FSDP2 all-gathers the next layer in this one's pre-forward
    (`set_modules_to_forward_prefetch`), after this layer's hook made the forward's
    stream wait for both chunks: with the forward and `step()` on different streams
    that is not refused as an all-gather made before its update; bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))

        def sharded() -> torch.nn.Module:
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(torch.nn.Linear(12, 12) for _ in range(6)))
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for layer, after in zip(model[:-1], model[1:], strict=True):
                layer.set_modules_to_forward_prefetch([after])
            return model

        plain_model, model = sharded(), sharded()
        plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
        opt = _overlapped(model, chunk_bytes=1)
        gen = torch.Generator().manual_seed(3)
        batches = [torch.randn(3, 12, generator=gen) for _ in range(4)]
        side = torch.Stream()
        on = {"step_stream": side} if where == "step" else {"forward_stream": side}
        _train_on_streams(model, opt, batches, **on)
        _train_on_streams(plain_model, plain, batches)
        for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor())
        opt.close()


def test_a_step_finished_inside_an_fsdp2_forward_orders_the_all_gathers_after_it(
    async_branches, monkeypatch
):
    """`wait_for_optimizer_step()` inside the forward (a pre-hook's, or a checkpoint
    thread's) lands the step, and the units the forward has not reached wait no more:
    their all-gather streams, which FSDP2 orders after the trainer's stream once per
    forward, at its start, must wait for the last update themselves."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    gather = _Stream()  # FSDP2's all-gather streams (none on the CPU)
    monkeypatch.setattr(
        offload.forward_overlap,
        "fsdp_all_gather_streams",
        lambda module: [gather] if isinstance(module, FSDPModule) else [],
    )
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(12, 12) for _ in range(6)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = _overlapped(model, chunk_bytes=1)
        gen = torch.Generator().manual_seed(3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(3, 12, generator=gen)).square().mean().backward()
            opt.step()
        last = opt._overlap.chunk_done[-1]
        model[1].register_forward_pre_hook(lambda *_: opt.wait_for_optimizer_step())
        model(torch.randn(3, 12, generator=gen))
        assert _waited_for(gather, last)
        opt.close()


def _searching_auto(model: torch.nn.Module, faster_up_to: float = 1.0) -> CPUOffloadOptimizer:
    """AdamW on `model` with overlap and "auto", its steps timed by `FakeSearchTimer`: the
    more state kept off the forward's path (up to `faster_up_to` of it), the faster."""
    from fake_step_timer import FakeSearchTimer

    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        chunk_bytes=512,
        staging_slots=2,
        overlap_forward=model,
        gpu_resident_bytes="auto",
    )
    state_bytes = sum(8 * p.numel() for p in model.parameters())

    def iteration_ms() -> float:
        kept = opt._resident_budget + (opt.backward_load_bytes or 0)
        return 100.0 - 30.0 * min(kept / state_bytes, faster_up_to)

    opt._auto.timer = FakeSearchTimer(iteration_ms, 10.0, 200.0)
    return opt


def test_auto_re_plans_with_no_host_wait_and_alone_no_collective(async_branches, monkeypatch):
    """ "auto" re-plans at a step's start, while the device still runs the backward: a host
    wait there (an event's synchronize, a collective's result read back) drains the device,
    which then idles while the host plans and builds. Alone in its process group, no step
    of the search waits on the host or runs a collective; the state moves on the trainer's
    stream in order (bitwise equal to plain AdamW)."""

    from offload.residency import AUTO_STEPS_AT_MOST

    synced: list[_Event] = []
    monkeypatch.setattr(_Event, "synchronize", lambda self: synced.append(self))
    collectives = []
    all_reduce = torch.distributed.all_reduce

    def counted(*args, **kwargs):
        collectives.append(args)
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_reduce", counted)
    plain_model, model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    with one_rank_group():
        opt = _searching_auto(model)
        gen = torch.Generator().manual_seed(3)
        plans, synced_in_step = [], []
        for _ in range(AUTO_STEPS_AT_MOST + 1):
            tokens = torch.randint(0, 40, (3, 4), generator=gen)
            for m, o in ((plain_model, plain), (model, opt)):
                o.zero_grad()
                m(tokens).square().mean().backward()
                before = len(synced)
                o.step()
            synced_in_step.append(len(synced) - before)
            plans.append(opt._executor.plan)
        assert opt.residency is not None and opt.residency.backward_load_bytes > 0
        replans = sum(a is not b for a, b in zip(plans, plans[1:], strict=False))
        assert replans >= 3 and opt.chunks_loaded_in_backward > 0
        assert synced_in_step == [0] * len(synced_in_step)
        assert collectives == []
        opt.wait_for_optimizer_step()
        assert_equal(plain_model, plain, model, opt)
        opt.close()


@pytest.mark.parametrize("faster_up_to", [1.0, 0.5], ids=["settles_largest", "settles_smaller"])
@pytest.mark.parametrize("both_plans_fit", [True, False], ids=["both_fit", "one_fits"])
def test_auto_re_plans_move_only_the_state_whose_residency_changes(
    async_branches, monkeypatch, faster_up_to, both_plans_fit
):
    """A re-plan of "auto" copies state resident before and after device to device, and
    only what joins or leaves the resident state crosses the host link (a round trip
    through the host put the trainer's stream behind twice its copies). Where both plans
    may be held at once, what the last backward loaded and the resident state leaving the
    device are copied device to device too, into the new resident state and the chunks the
    new plan loads in the backward, which its first step does not load again (it loaded
    them all through the forward). Bitwise equal to plain AdamW."""

    from offload.residency import AUTO_STEPS_AT_MOST

    monkeypatch.setattr(CPUOffloadOptimizer, "_both_plans_fit", lambda self, step: both_plans_fit)
    plain_model, model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = _searching_auto(model, faster_up_to)
    moves = []  # per re-plan: resident state before, after; bytes to the host, from it, within
    carried = []  # per re-plan: its step, the chunks it copied in on the device, their bytes
    loads: list[set[int]] = []  # per step: the chunks it loaded from the host

    def resident() -> dict[tuple[int, str], int]:  # (param, key) -> bytes
        chunks = opt._executor.plan.chunks
        return {
            (v.param, v.spec.key): v.spec.numel * v.spec.dtype.itemsize
            for c in chunks
            if c.resident
            for v in c.views
        }

    replan, copy = CPUOffloadOptimizer._replan, torch.Tensor.copy_
    replanning = [False]

    def counted_copy(self, source, non_blocking=False):
        if replanning[0]:
            host = {s.untyped_storage().data_ptr() for s in opt._executor.host_slabs.values()}
            nbytes = self.numel() * self.element_size()
            if self.untyped_storage().data_ptr() in host:
                moves[-1][2] += nbytes
            elif source.untyped_storage().data_ptr() in host:
                moves[-1][3] += nbytes
            else:
                moves[-1][4] += nbytes
        return copy(self, source, non_blocking=non_blocking)

    def counted_replan(self, *args, **kwargs):
        moves.append([resident(), {}, 0, 0, 0])
        replanning[0] = True
        try:
            replan(self, *args, **kwargs)
        finally:
            replanning[0] = False
        moves[-1][1] = resident()
        executor = opt._executor
        copied = {executor.schedule.loaded_in_backward[i] for i in executor.loaded_ahead}
        nbytes = sum(
            h.numel() * h.element_size() for c in copied for h, _ in executor.chunks[c].copies
        )
        carried.append((len(loads) - 1, copied, nbytes))
        loads[-1] = set()  # the old plan's loads in the backward are of its own chunks

    load = offload.executor.StepExecutor._load

    def watched_load(self, chunk, *args, **kwargs):
        loads[-1].add(next(c for c, x in enumerate(self.chunks) if x is chunk))
        return load(self, chunk, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    monkeypatch.setattr(CPUOffloadOptimizer, "_replan", counted_replan)
    monkeypatch.setattr(offload.executor.StepExecutor, "_load", watched_load)
    gen = torch.Generator().manual_seed(3)
    for _ in range(AUTO_STEPS_AT_MOST + 1):
        tokens = torch.randint(0, 40, (3, 4), generator=gen)
        for m, o in ((plain_model, plain), (model, opt)):
            if o is opt:  # the loads of the step to come: in the backward, step(), forward
                loads.append(set())
            o.zero_grad()
            m(tokens).square().mean().backward()
            o.step()
    assert opt.residency is not None
    assert len(moves) >= 3
    assert any(after and before.keys() > after.keys() for before, after, *_ in moves)  # left
    assert any(before and before.keys() < after.keys() for before, after, *_ in moves)  # joined
    for (before, after, to_host, from_host, within), (step, copied, into_slots) in zip(
        moves, carried, strict=True
    ):
        left = sum(n for key, n in before.items() if key not in after)
        joined = sum(n for key, n in after.items() if key not in before)
        stayed = sum(n for key, n in after.items() if key in before)
        assert (to_host, from_host + within) == (left, joined + stayed + into_slots)
        assert within >= stayed and not (copied and not both_plans_fit)
        assert not copied & loads[step]  # its first step did not load them again
    assert any(copied for _, copied, _ in carried) == both_plans_fit
    assert opt.plan.resident_bytes > 0
    opt.wait_for_optimizer_step()
    assert_equal(plain_model, plain, model, opt)
    opt.close()


def test_auto_loads_in_the_last_measured_backward_what_its_first_split_copies_on_device(
    async_branches, monkeypatch
):
    """The last measured step re-plans for its backward to load the leading chunks within
    what the backward may carry; the first split the search tries keeps the leading units
    resident, and its re-plan copies their state from those chunks device to device: of
    the state that joins the resident state, only what they did not hold crosses the host
    link (it all did, the forward before it having loaded everything). The measured steps'
    forwards still load everything. Bitwise equal to plain AdamW."""
    from offload.residency import AUTO_MEASURED_STEPS, AUTO_STEPS_AT_MOST, AUTO_WARMUP_STEPS

    monkeypatch.setattr(CPUOffloadOptimizer, "_both_plans_fit", lambda self, step: True)
    plain_model, model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    opt = _searching_auto(model)
    opt_timer = opt._auto.timer
    replans = []  # (step, split, resident bytes after, bytes into it from the host slabs)
    loaded_ahead = []  # per step: chunks its backward had loaded when it started
    replan, copy = CPUOffloadOptimizer._replan, torch.Tensor.copy_
    from_host = [None, None]  # into the resident state at a re-plan: from the host, on device

    def counted_copy(self, source, non_blocking=False):
        if from_host[0] is not None:
            executor = opt._executor
            host = {s.untyped_storage().data_ptr() for s in executor.host_slabs.values()}
            resident = {s.untyped_storage().data_ptr() for s in executor.resident_slabs.values()}
            nbytes = self.numel() * self.element_size()
            if self.untyped_storage().data_ptr() in resident:
                from_host[0 if source.untyped_storage().data_ptr() in host else 1] += nbytes
        return copy(self, source, non_blocking=non_blocking)

    def counted_replan(self, split, *args, **kwargs):
        from_host[:] = [0, 0]
        try:
            replan(self, split, *args, **kwargs)
        finally:
            resident = sum(  # each resident state tensor's bytes
                {
                    (v.param, v.spec.key): v.spec.numel * v.spec.dtype.itemsize
                    for c in self.plan.chunks
                    if c.resident
                    for v in c.views
                }.values()
            )
            replans.append((len(loaded_ahead) - 1, split, resident, *from_host))
            from_host[:] = [None, None]

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    monkeypatch.setattr(CPUOffloadOptimizer, "_replan", counted_replan)
    gen = torch.Generator().manual_seed(3)
    for _ in range(AUTO_STEPS_AT_MOST + 1):
        tokens = torch.randint(0, 40, (3, 4), generator=gen)
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            m(tokens).square().mean().backward()
            if o is opt:
                loaded_ahead.append(len(opt._executor.loaded_ahead))
            o.step()
            if o is opt and len(loaded_ahead) == AUTO_WARMUP_STEPS + 1:
                measured_chunks = len(opt._executor.chunks)  # the plan the model reads
    last_measured = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS - 1
    # the stall model's profiles: the steps that ran that plan (the loads in the backward
    # cut the first chunks otherwise)
    profiles = opt_timer.recorded
    assert len(profiles) == AUTO_MEASURED_STEPS - 1
    assert all(len(p.chunk_done_ms) == measured_chunks for p in profiles)
    assert loaded_ahead[: last_measured + 1] == [0] * (last_measured + 1)
    (step, split, resident, *_), (first, largest, kept, over_link, on_device) = replans[:2]
    assert (step, split.resident_bytes) == (last_measured, 0) and split.backward_load_bytes > 0
    assert first == last_measured + 1 and loaded_ahead[first] > 0
    assert largest.resident_bytes > 0 and resident == 0 < kept
    assert over_link + on_device == kept and on_device > 0
    opt.wait_for_optimizer_step()
    assert_equal(plain_model, plain, model, opt)
    opt.close()


def test_a_rebuild_into_new_host_slabs_reads_the_old_ones_before_they_go(
    async_branches, monkeypatch
):
    """Loading state of another layout (AdamW's amsgrad turned off) plans into new host
    slabs, and the old ones are unpinned and freed once the build returns: what copies out
    of them blocks (a non-blocking copy could still be reading them after)."""
    plain_model, model = _model(), _model()
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, amsgrad=True)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True),
        chunk_bytes=512,
        staging_slots=2,
        overlap_forward=model,
        gpu_resident_bytes=6000,
    )
    gen = torch.Generator().manual_seed(3)

    def iteration() -> None:
        tokens = torch.randint(0, 40, (3, 4), generator=gen)
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            m(tokens).square().mean().backward()
            o.step()

    for _ in range(3):
        iteration()
    for o in (plain, opt):
        state_dict = o.state_dict()
        for group in state_dict["param_groups"]:
            group["amsgrad"] = False
        for entries in state_dict["state"].values():
            del entries["max_exp_avg_sq"]
        o.load_state_dict(state_dict)
    old = {slab.untyped_storage().data_ptr() for slab in opt._executor.host_slabs.values()}
    unblocked, building = [], [False]
    copy, build = torch.Tensor.copy_, offload.executor.StepExecutor.build

    def watched(self, source, non_blocking=False):
        if building[0] and non_blocking and source.untyped_storage().data_ptr() in old:
            unblocked.append(tuple(source.shape))
        return copy(self, source, non_blocking=non_blocking)

    def watched_build(self, *args, **kwargs):
        building[0] = True
        try:
            build(self, *args, **kwargs)
        finally:
            building[0] = False

    monkeypatch.setattr(torch.Tensor, "copy_", watched)
    monkeypatch.setattr(offload.executor.StepExecutor, "build", watched_build)
    iteration()
    new = {slab.untyped_storage().data_ptr() for slab in opt._executor.host_slabs.values()}
    assert not new & old and opt.plan.resident_bytes > 0
    assert unblocked == []
    opt.wait_for_optimizer_step()
    assert_equal(plain_model, plain, model, opt)
    opt.close()
