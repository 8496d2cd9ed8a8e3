"""What torchtitan's debug job reads from a source checkout, made here instead.

torchtitan 0.3.0's `llama3_debugmodel` job loads its tokenizer from
`./tests/assets/tokenizer` and its data, through HF `datasets`, from
`./tests/assets/c4_test`; neither ships in the wheel. Here:

- `write_tokenizer(folder, vocab_size)` writes a word-level `tokenizer.json`
  (built with the `tokenizers` library: "<|begin_of_text|>", "<|end_of_text|>",
  "<unk>", then "w0", "w1", ...) and a `tokenizer_config.json` naming BOS and
  EOS, which torchtitan's own `HuggingFaceTokenizer` loads from `folder`
  (`Trainer.Config.hf_assets_path`).
- `SyntheticTextDataLoader` is a torchtitan dataloader (`ParallelAwareDataloader`,
  so torchdata's `StatefulDataLoader` batches it) over seeded random documents of
  those words, encoded by that tokenizer with BOS and EOS, one document per
  sample, in the `({"input", "positions"}, labels)` form of torchtitan's
  `HuggingFaceTextDataset`. Sample `i` of data-parallel rank `r` comes from
  `random.Random(f"{seed}/{r}/{i}")`, so a run's batches depend on nothing else.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"
SPECIAL_TOKENS = (BOS, EOS, UNK)


def write_tokenizer(folder: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer of `vocab_size` tokens (3 special, then "w0", "w1", ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size should be > {len(SPECIAL_TOKENS)} but is: {vocab_size}")
    words = [f"w{i}" for i in range(vocab_size - len(SPECIAL_TOKENS))]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    (folder / "tokenizer_config.json").write_text(json.dumps(config) + "\n")


class SyntheticTextDataset(IterableDataset):
    """Endless seeded documents of `seq_len - 1` tokenizer words, BOS and EOS added."""

    def __init__(self, tokenizer: BaseTokenizer, *, seq_len: int, seed: int, dp_rank: int):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.dp_rank = dp_rank
        self.words = sorted(
            (token for token in tokenizer.get_vocab() if token not in SPECIAL_TOKENS),
            key=tokenizer.token_to_id,
        )

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        sample = 0
        while True:
            rng = random.Random(f"{self.seed}/{self.dp_rank}/{sample}")
            text = " ".join(rng.choices(self.words, k=self.seq_len - 1))
            tokens = torch.tensor(self.tokenizer.encode(text, add_bos=True, add_eos=True))
            if tokens.numel() != self.seq_len + 1:
                raise RuntimeError(
                    f"the tokenizer made {tokens.numel()} tokens of {self.seq_len - 1} words "
                    f"plus BOS and EOS; expected {self.seq_len + 1}"
                )
            positions = torch.arange(self.seq_len)
            yield {"input": tokens[:-1], "positions": positions}, tokens[1:]
            sample += 1


class SyntheticTextDataLoader(ParallelAwareDataloader):
    """torchtitan's parallel-aware dataloader over `SyntheticTextDataset`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        seed: int = 0
        """Seed of the documents (each data-parallel rank draws its own)."""

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        # The keyword arguments torchtitan's HuggingFaceTextDataLoader passes on.
        super().__init__(
            SyntheticTextDataset(tokenizer, seq_len=seq_len, seed=config.seed, dp_rank=dp_rank),
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            num_workers=config.num_workers,
            persistent_workers=config.persistent_workers,
            pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
            snapshot_every_n_steps=snapshot_every_n_steps,
            batch_size=local_batch_size,
        )
