"""End to end on 2 gloo ranks with FSDP2: offload (with and without forward overlap)
trains bitwise like no offload, for AdamW and Muon, and a DCP checkpoint taken
mid-run (`dcp.save` or `dcp.async_save`) resumes bitwise."""

from __future__ import annotations

import os

import torch
from spawn_ranks import run_on_ranks

WORLD = 2
STEPS = 4
RESUME_AT = 2


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 23), torch.nn.GELU(), torch.nn.Linear(23, 16))
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.lm_head(self.norm(h))


def _build(mesh, config_kwargs):
    from torch.distributed.fsdp import fully_shard

    from muon_offload import OptimizerConfig, setup_optimizer

    torch.manual_seed(0)
    model = TinyLM()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, setup_optimizer(model, OptimizerConfig(lr=1e-2, **config_kwargs))


def _train(model, optimizer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 32, (2, 5), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        ).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    if hasattr(optimizer, "wait_for_optimizer_step"):
        optimizer.wait_for_optimizer_step()


def _locals(model) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _worker(rank: int, world: int, ckpt_root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    failures = []
    for opt_type in ("adamw", "muon"):
        model, opt = _build(mesh, {"type": opt_type})
        _train(model, opt, rank, range(STEPS))
        reference = _locals(model)
        for overlap in (False, True):
            name = f"{opt_type}/overlap={overlap}/{'async_save' if overlap else 'save'}"
            offload = {
                "type": opt_type,
                "offload": "optimizer",
                "offload_overlap_forward": overlap,
                "offload_chunk_bytes": 512,
            }
            model, opt = _build(mesh, offload)
            _train(model, opt, rank, range(RESUME_AT))
            ckpt = os.path.join(ckpt_root, f"{opt_type}-{overlap}")
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optim": optim_sd}
            if overlap:  # both ways to save, one per arm
                dcp.async_save(state, checkpoint_id=ckpt).result()
            else:
                dcp.save(state, checkpoint_id=ckpt)
            _train(model, opt, rank, range(RESUME_AT, STEPS))
            if not _same(reference, _locals(model)):
                failures.append(f"{name}: offloaded run differs from plain")

            resumed, ropt = _build(mesh, offload)
            model_sd, optim_sd = get_state_dict(resumed, ropt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(
                resumed,
                ropt,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
            )
            slabs = {d: t.data_ptr() for d, t in ropt._executor.host_slabs.items()}
            _train(resumed, ropt, rank, range(RESUME_AT, STEPS))
            if not _same(reference, _locals(resumed)):
                failures.append(f"{name}: resumed run differs from uninterrupted")
            if {d: t.data_ptr() for d, t in ropt._executor.host_slabs.items()} != slabs:
                failures.append(f"{name}: host slabs were reallocated")
    assert not failures, failures


def test_offload_overlap_and_dcp_resume_are_bitwise(tmp_path):
    run_on_ranks(_worker, WORLD, str(tmp_path))
