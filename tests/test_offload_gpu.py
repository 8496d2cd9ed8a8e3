"""CPUOffloadOptimizer on CUDA: bitwise, pinned, stable buffers, bounded GPU memory."""

from __future__ import annotations

import pytest
import torch

from offload import CPUOffloadOptimizer
from offload.residency import (
    AUTO_MEASURED_STEPS,
    AUTO_STEPS_AT_MOST,
    AUTO_WARMUP_STEPS,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MiB = 2**20


def make_params(seed: int = 0, layers: int = 8, dim: int = 1024) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(dim, dim), (4 * dim + 3, dim), (dim,), (dim, 4 * dim + 3)] * (layers // 2)
    return [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]


def set_grads(params, step: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)


# chunk_bytes=1 would now be one 64-element slice a chunk: ~600k chunks a step here
@pytest.mark.parametrize("chunk_bytes", [2**40, 8 * MiB, MiB])
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, foreach=False),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    ],
    ids=["adamw_foreach", "adamw_fused", "adam_amsgrad", "sgd"],
)
def test_cuda_offload_is_bitwise_equal(make, chunk_bytes):
    plain_params, offload_params = make_params(), make_params()
    plain = make(plain_params)
    offloaded = CPUOffloadOptimizer(make(offload_params), chunk_bytes=chunk_bytes)
    sched = torch.optim.lr_scheduler.StepLR(offloaded, step_size=2, gamma=0.5)
    plain_sched = torch.optim.lr_scheduler.StepLR(plain, step_size=2, gamma=0.5)
    for step in range(5):
        set_grads(plain_params, step)
        set_grads(offload_params, step)
        torch.nn.utils.clip_grad_norm_(plain_params, 1.0)
        torch.nn.utils.clip_grad_norm_(offload_params, 1.0)
        plain.step()
        offloaded.step()
        plain_sched.step()
        sched.step()
    for a, b in zip(plain_params, offload_params, strict=True):
        assert torch.equal(a, b)
    ref, got = plain.state_dict()["state"], offloaded.state_dict()["state"]
    for index, entries in ref.items():
        for key, value in entries.items():
            assert torch.equal(value.cpu(), got[index][key].cpu()), (index, key)
            if value.ndim >= 1:
                assert got[index][key].is_pinned()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1024, 768, device="cuda").t(),
        lambda: torch.randn(8, 16, 12, 12, device="cuda").contiguous(
            memory_format=torch.channels_last
        ),
    ],
    ids=["transposed", "channels_last"],
)
def test_cuda_fused_adamw_on_strided_params_is_bitwise_equal(make):
    """Issue 25 item 1: fused kernels pair elements by memory, so the state is laid out
    like the param."""

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(make()), torch.nn.Parameter(torch.randn(4096, device="cuda"))]

    plain_params, offload_params = params(), params()
    plain = torch.optim.AdamW(plain_params, lr=1e-2, fused=True)
    offloaded = CPUOffloadOptimizer(
        torch.optim.AdamW(offload_params, lr=1e-2, fused=True), chunk_bytes=MiB
    )
    for step in range(3):
        gen = torch.Generator(device="cuda").manual_seed(step)
        for a, b in zip(plain_params, offload_params, strict=True):
            grad = torch.randn(a.shape, device="cuda", generator=gen)
            a.grad = torch.empty_like(a).copy_(grad)  # laid out like the param
            b.grad = torch.empty_like(b).copy_(grad)
        plain.step()
        offloaded.step()
    offloaded.wait_for_optimizer_step()
    for a, b in zip(plain_params, offload_params, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain.state[a][key], offloaded.state[b][key].cuda()), key


def test_ring_is_staging_slots_x_chunk_bytes_and_lives_only_in_the_step():
    params = make_params(layers=16, dim=1024)  # 4099 x 1024 params: 32 MiB of AdamW state
    chunk_bytes = 16 * MiB
    opt = CPUOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), chunk_bytes=chunk_bytes)
    slabs = None
    for step in range(3):
        set_grads(params, step)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # params + grads: no ring between steps
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert any(c.slices for c in opt.plan.chunks)  # the large params are sliced
        slot = opt.plan.staging_bytes(1)
        assert 0.9 * chunk_bytes < slot <= chunk_bytes  # a slot is what chunk_bytes says
        ring = opt.staging_slots * slot
        # Every step adds AdamW's temporaries for one chunk (param-sized: half the chunk,
        # twice over for a foreach sqrt and div); step 0 also creates one chunk's state
        # before adopting it. Slack: 8 MiB for the allocator's rounding.
        bound = ring + chunk_bytes + (chunk_bytes if step == 0 else 0) + 8 * MiB
        assert ring <= peak <= bound, (step, peak, ring, bound)
        assert torch.cuda.memory_allocated() == base  # the ring went back to the allocator
        now = {d: t.data_ptr() for d, t in opt._executor.host_slabs.items()}
        assert slabs is None or now == slabs
        slabs = now
    for entries in opt.state.values():
        assert entries["exp_avg"].is_pinned() and entries["exp_avg"].device.type == "cpu"


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(512, 512), torch.nn.GELU()]
    return torch.nn.Sequential(*layers).cuda()


@pytest.mark.parametrize("resident", ["none", "half", "auto"])
@pytest.mark.parametrize("mode", ["plain", "overlap", "overlap+bwd"])
def test_cuda_step_never_syncs_the_host_and_overlap_is_bitwise(mode, resident):
    overlap = mode != "plain"
    plain_model, model = make_model(), make_model()
    state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())
    budget = {"none": 0, "half": state_bytes // 2, "auto": "auto"}[resident]
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, foreach=True)
    opt = CPUOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True),
        chunk_bytes=MiB // 2,  # a 512 x 512 param's AdamW state is 2 MiB: sliced
        overlap_forward=model if overlap else None,
        gpu_resident_bytes=budget,
        load_in_backward=mode == "overlap+bwd",
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    decides = AUTO_WARMUP_STEPS + AUTO_MEASURED_STEPS
    steps = AUTO_STEPS_AT_MOST + 1 if resident == "auto" else 7
    inputs = [torch.randn(64, 512, device="cuda", generator=gen) for _ in range(steps)]
    for step, x in enumerate(inputs):
        for m, o in ((plain_model, plain), (model, opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            # step 0 pins the host slabs, and "auto"'s first decision (step 4) reads its
            # measured steps' events: documented syncs; its later re-plans sync nothing
            first_decision = resident == "auto" and step == decides
            if o is opt and step > 0 and not first_decision:
                torch.cuda.set_sync_debug_mode("error")
            try:
                o.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    opt.wait_for_optimizer_step()
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    ref, got = plain.state_dict()["state"], opt.state_dict()["state"]
    for index, entries in ref.items():
        for key, value in entries.items():
            assert torch.equal(value.cpu(), got[index][key].cpu()), (index, key)
    assert resident == "auto" or any(c.slices for c in opt.plan.chunks)
    if mode == "overlap+bwd":  # the last step found its first chunks loaded in the backward
        # (what its schedule says: the ring's, or what "auto" chose)
        assert opt.chunks_loaded_in_backward == opt.schedule.backward_loads
        assert resident == "auto" or opt.chunks_loaded_in_backward == opt.staging_slots
    on_gpu = sum(
        t.numel() * t.element_size()
        for entries in opt.state.values()
        for t in entries.values()
        if t.ndim >= 1 and t.device.type == "cuda"
    )
    assert on_gpu <= opt.plan.resident_bytes and (on_gpu > 0) == (opt.plan.resident_bytes > 0)
    if resident == "half":
        assert 0 < on_gpu <= budget
    if resident == "auto":  # settled within the default budget, the device's headroom
        assert isinstance(opt.gpu_resident_bytes, int)
        assert opt.residency.resident_bytes == opt.gpu_resident_bytes
        assert opt.plan.resident_bytes <= opt.residency.budget_bytes
        # the copies outlast this tiny forward: the trainer's stream measurably stalled
        assert opt.residency.measured_stall_ms > 0
    for entries in opt.state.values():
        for t in entries.values():
            if t.ndim >= 1 and t.device.type == "cpu":
                assert t.is_pinned()


def test_fsdp2_state_stays_on_the_host_and_dcp_resumes_bitwise(tmp_path):
    """DTensor state wraps the pinned host views, never a GPU copy of them; a DCP
    checkpoint saves and loads it from host memory and resumes bitwise."""
    import os
    import socket

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))

        def build(overlap: bool):
            model = make_model()
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = CPUOffloadOptimizer(
                torch.optim.AdamW(model.parameters()),
                chunk_bytes=2 * MiB,
                staging_slots=2,
                overlap_forward=model if overlap else None,
            )
            return model, opt

        def train(model, opt, steps):
            gen = torch.Generator(device="cuda").manual_seed(steps)
            for _ in range(steps):
                opt.zero_grad()
                model(torch.randn(8, 512, device="cuda", generator=gen)).square().mean().backward()
                opt.step()
            opt.wait_for_optimizer_step()

        model, opt = build(overlap=False)
        state_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())
        train(model, opt, 3)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        train(model, opt, 1)
        assert torch.cuda.memory_allocated() == before  # nothing left behind on the GPU
        assert opt.plan.staging_bytes(opt.staging_slots) < state_bytes
        for p in model.parameters():
            local = opt.state[p]["exp_avg"].to_local()
            assert local.device.type == "cpu" and local.is_pinned()

        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
        train(model, opt, 2)
        reference = [p.to_local().clone() for p in model.parameters()]

        resumed, ropt = build(overlap=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model_sd, optim_sd = get_state_dict(resumed, ropt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=str(tmp_path))
        set_state_dict(
            resumed, ropt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
        )
        torch.cuda.synchronize()
        # DCP's state init steps once on zero grads, creating state chunk by chunk into what
        # a step's plan holds (the ring and the backward's slots) + a chunk + AdamW's
        # temporaries for one, and loads into host memory: never all state.
        held = ropt.plan.held_bytes(ropt.schedule.slots, ropt.staging_slots)
        largest_chunk = ropt.plan.staging_bytes(1)
        grad_bytes = state_bytes // 2
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= grad_bytes + held + 2 * largest_chunk + MiB, peak
        assert held < state_bytes and ropt.schedule.extra_slots > 0
        train(resumed, ropt, 2)
        for a, b in zip(reference, resumed.parameters(), strict=True):
            assert torch.equal(a, b.to_local())
    finally:
        dist.destroy_process_group()


def test_cuda_serial_path_with_state_created_on_a_later_step():
    class SerialAdamW(torch.optim.AdamW):
        """Unknown to the adapter: takes the serial path."""

    plain_params, offload_params = make_params(layers=4), make_params(layers=4)
    plain = torch.optim.AdamW(plain_params, lr=1e-3)
    offloaded = CPUOffloadOptimizer(SerialAdamW(offload_params, lr=1e-3))
    for step in range(4):
        set_grads(plain_params, step)
        set_grads(offload_params, step)
        if step < 2:  # the last param gets its first grad on step 2
            plain_params[-1].grad = offload_params[-1].grad = None
        plain.step()
        offloaded.step()
    for a, b in zip(plain_params, offload_params, strict=True):
        assert torch.equal(a, b)
    for entries in offloaded.state.values():
        assert entries["exp_avg"].device.type == "cpu" and entries["exp_avg"].is_pinned()


@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_grad_scaler_with_fused_adamw_is_bitwise_equal(overlap):
    """GradScaler hands fused AdamW its scale and inf flag on the device; offloaded (its
    chunks on the side stream, after `scaler.update()` with overlap) as unwrapped, a step
    skipped on inf included."""
    runs = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)]).cuda()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        opt = inner
        if wrap:
            opt = CPUOffloadOptimizer(
                inner, chunk_bytes=MiB // 4, overlap_forward=model if overlap else None
            )
        scaler = torch.amp.GradScaler("cuda", init_scale=1000.0, growth_interval=1)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for step in range(5):
            x = torch.randn(32, 256, device="cuda", generator=gen)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            if step == 2:
                model[3].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        if wrap:
            opt.wait_for_optimizer_step()
        runs.append((model, scaler.get_scale()))
    (plain_model, plain_scale), (model, scale) = runs
    assert scale == plain_scale == 1000.0 * 2**3
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_cuda_graph_captured_over_an_overlapped_forward_is_refused():
    # a replay runs no hooks: it read whatever the pending step had enqueued by then, with
    # nothing said (torchtitan captures forward and backward unless told not to)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(3)]).cuda()
    opt = CPUOffloadOptimizer(torch.optim.AdamW(model.parameters()), overlap_forward=model)
    x = torch.ones(8, 64, device="cuda")
    model(x).sum().backward()
    opt.step()
    opt.wait_for_optimizer_step()
    with pytest.raises(RuntimeError, match="CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(x)
    opt.close()
