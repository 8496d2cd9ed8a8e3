"""`transformers.Trainer` with our optimizer (`muon_offload.hf_trainer.Trainer`): AdamW and
Muon, offload + forward overlap bitwise equal to no offload, and a run resumed from the
Trainer's checkpoint bitwise equal to the uninterrupted one.

On the CPU without FSDP: accelerate applies its FSDP plugin only on accelerators
(its CPU path, MULTI_CPU, ignores the plugin; accelerate 1.15), so FSDP2 through
accelerate (`fsdp_version=2`) is the GPU test, in deterministic mode.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from bench import hf_llama
from muon_offload import OptimizerConfig

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

PRESET = "hf-llama-tiny"
STEPS, SAVE_AT = 4, 2


class Tokens(torch.utils.data.Dataset):
    """A few fixed sequences, repeated: the loss falls within STEPS steps."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i % 4)
        tokens = torch.randint(hf_llama.PRESETS[PRESET]["vocab_size"], (32,), generator=gen)
        return {"input_ids": tokens, "labels": tokens}


def train(
    config: OptimizerConfig, out: Path, *, fsdp: bool, resume: Path | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS Trainer steps (a checkpoint at SAVE_AT); the logged losses and final params."""
    from transformers import TrainingArguments

    from muon_offload.hf_trainer import Trainer

    device = torch.device("cuda" if fsdp else "cpu")
    model = hf_llama.build_hf_llama(PRESET, device, seed=0, attn_implementation="eager")
    extra = {}
    if fsdp:
        extra = dict(
            fsdp=True,
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            bf16=True,
            full_determinism=True,
        )
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        seed=0,
        use_cpu=not fsdp,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizer_config=config)
    if fsdp:
        assert trainer.is_fsdp_enabled, "accelerate did not turn on its FSDP plugin"
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper around ours
    getattr(optimizer, "wait_for_optimizer_step", lambda: None)()
    if fsdp:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(trainer.model.model.layers[0], FSDPModule)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = {
        name: getattr(p, "full_tensor", lambda p=p: p)().detach().clone()
        for name, p in trainer.model.named_parameters()
    }
    getattr(optimizer, "close", lambda: None)()
    return losses, params


def assert_offload_and_resume_bitwise(opt: str, tmp: Path, *, fsdp: bool) -> None:
    plain = OptimizerConfig(type=opt, lr=1e-2)
    offloaded = dataclasses.replace(
        plain, offload="optimizer", offload_overlap_forward=True, offload_chunk_bytes=16 * 2**10
    )
    ref_losses, ref_params = train(plain, tmp / "none", fsdp=fsdp)
    losses, params = train(offloaded, tmp / "offload", fsdp=fsdp)
    assert len(ref_losses) == STEPS and ref_losses[-1] < ref_losses[0]
    assert losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(params[name], ref), f"offload: {name} differs"
    resumed_losses, resumed = train(
        offloaded, tmp / "resumed", fsdp=fsdp, resume=tmp / "offload" / f"checkpoint-{SAVE_AT}"
    )
    # The first SAVE_AT come from the checkpoint's trainer state, the rest were trained.
    assert resumed_losses == ref_losses
    for name, ref in ref_params.items():
        assert torch.equal(resumed[name], ref), f"resumed: {name} differs"


OPTIMIZERS = ["adamw", "muon"]


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_trainer_offload_overlap_and_resume_are_bitwise(opt, tmp_path):
    assert_offload_and_resume_bitwise(opt, tmp_path, fsdp=False)


def _gpu_body(rank: int, port: int, tmp: str, opt: str) -> None:
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    # Before any CUDA work: cuBLAS reads it when it creates its handle (full_determinism
    # sets it too, but only once the Trainer is built).
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    assert_offload_and_resume_bitwise(opt, Path(tmp), fsdp=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_trainer_fsdp2_through_accelerate_offload_and_resume_are_bitwise_on_gpu(opt):
    """FSDP2 through accelerate (`fsdp_version=2`), bf16, `full_determinism=True`
    (deterministic algorithms, CUBLAS_WORKSPACE_CONFIG); in a process of its own so
    neither the determinism nor accelerate's state leaks into other tests."""
    from bench.train import free_port

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_body, args=(free_port(), tmp, opt), nprocs=1, join=True)


def test_the_trainers_own_optimizer_settings_are_told_apart_from_the_configs(tmp_path):
    # TrainingArguments' learning_rate, weight_decay, betas and optim were silently not
    # used, optimizer_cls_and_kwargs trained with the config's optimizer all the same,
    # and a scheduler passed in drove another optimizer than the one the Trainer built
    import warnings

    from transformers import TrainingArguments

    from muon_offload.hf_trainer import Trainer

    model = hf_llama.build_hf_llama(PRESET, torch.device("cpu"), seed=0)
    config = OptimizerConfig(type="muon", lr=1e-2)

    def build(config=config, **options):
        args = TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to=[], **options.pop("args", {})
        )
        return Trainer(
            model=model, args=args, train_dataset=Tokens(), optimizer_config=config, **options
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build(args={"learning_rate": 1e-2})  # the config's own lr: nothing to tell
    told = r"sets learning_rate=2e-05, weight_decay=0.01, optim='sgd', which this Trainer does"
    with pytest.warns(UserWarning, match=told):
        build(args={"learning_rate": 2e-5, "weight_decay": 0.01, "optim": "sgd"})
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs set with optimizer_config"):
        build(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5}))
    with pytest.raises(ValueError, match=r"optimizers=\(None, scheduler\)"):
        build(optimizers=(None, object()))
    with pytest.raises(TypeError, match="optimizer_config should be an OptimizerConfig"):
        build(config={"type": "muon"})
    # passed by position, as transformers.Trainer's signature allows: the optimizer
    # trained instead of the config's, and optimizer_cls_and_kwargs was dropped, silently
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    positional = [model, args, None, Tokens(), None, None, None, None, None, None]
    with pytest.raises(ValueError, match="optimizers=.* set with optimizer_config"):
        Trainer(*positional, (sgd, None), optimizer_config=config)
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs set with optimizer_config"):
        Trainer(*positional, (None, None), (torch.optim.SGD, {"lr": 0.5}), optimizer_config=config)
    # LOMO's training_step hands the lr to backward(): it warned "not used", then every
    # step failed in backward()
    for optim in ("lomo", "adalomo"):
        with pytest.raises(ValueError, match=rf"TrainingArguments\(optim='{optim}'\)"):
            build(args={"optim": optim})


def test_resuming_with_another_optimizer_type_says_the_config_differs(tmp_path):
    # torch's "loaded state dict has a different number of parameter groups" alone
    train(OptimizerConfig(type="muon", lr=1e-2), tmp_path / "muon", fsdp=False)
    with pytest.raises(
        ValueError, match=r"does not fit the optimizer built now \(optimizer_config type='adamw'"
    ):
        train(
            OptimizerConfig(type="adamw", lr=1e-2),
            tmp_path / "adamw",
            fsdp=False,
            resume=tmp_path / "muon" / f"checkpoint-{SAVE_AT}",
        )


def test_resuming_from_a_checkpoint_without_optimizer_state_says_both_start_anew(tmp_path):
    # a save_only_model=True checkpoint: the optimizer's state and the schedule started
    # anew with no word, against the README's "a resumed run takes the optimizer's state"
    # (hostile review)
    config = OptimizerConfig(type="muon", lr=1e-2)
    train(config, tmp_path / "run", fsdp=False)
    checkpoint = tmp_path / "run" / f"checkpoint-{SAVE_AT}"
    for path in checkpoint.iterdir():
        if path.name.startswith(("optimizer", "scheduler")):
            path.unlink()  # what save_only_model=True leaves out
    with pytest.warns(UserWarning, match=r"holds no optimizer state \(saved with save_only"):
        train(config, tmp_path / "resumed", fsdp=False, resume=checkpoint)
