"""Synthetic token streams the demo can learn in a few dozen steps.

A fixed random first-order Markov chain: every token has a few successors
with skewed probabilities, so the next-token loss can fall from ln(vocab)
(~5.5 for 256 tokens) to about the chain's entropy rate (~1) once the model
has learned the transition table. Made here, so the demo needs no download.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Probabilities of a token's successors, most likely first (entropy ~1.1 nats).
SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)


def check_vocab_size(vocab_size: int) -> None:
    """Room for each token's distinct successors, with random gaps between them."""
    if vocab_size < 2 * len(SUCCESSOR_PROBS):
        raise ValueError(f"vocab_size should be >= {2 * len(SUCCESSOR_PROBS)} but is: {vocab_size}")


class MarkovData:
    """Batches of (inputs, targets) from one Markov chain shared by all ranks.

    The chain depends on `seed` only; the sampled sequences also on `rank`
    (each rank reads its own shard of the stream) and on `stream` (e.g. train
    vs eval), and repeat exactly for the same arguments.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        *,
        rank: int = 0,
        seed: int = 0,
        stream: int = 0,
    ) -> None:
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        chain = torch.Generator().manual_seed(seed)
        k = len(SUCCESSOR_PROBS)
        check_vocab_size(vocab_size)
        # k distinct successors per token without a vocab x vocab table (32k vocab:
        # 4 GiB): a random first one, then random gaps that sum to less than vocab.
        first = torch.randint(vocab_size, (vocab_size, 1), generator=chain)
        gaps = torch.randint(1, vocab_size // k, (vocab_size, k - 1), generator=chain)
        self.successors = (torch.cat([first, first + gaps.cumsum(1)], dim=1)) % vocab_size
        self._probs = torch.tensor(SUCCESSOR_PROBS)
        # A sampling seed per (seed, rank, stream): each rank reads its own stream.
        self._gen = torch.Generator().manual_seed(((seed * 1009 + rank) * 1013 + stream) + 1)

    def entropy_rate(self) -> float:
        """The loss floor in nats: every row has the same successor distribution."""
        return float(-(self._probs * self._probs.log()).sum())

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """(batch, seq_len) int64 inputs and the next tokens as targets, on the CPU."""
        tokens = torch.empty(self.batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=self._gen)
        choice = torch.multinomial(
            self._probs, self.batch_size * self.seq_len, replacement=True, generator=self._gen
        ).view(self.batch_size, self.seq_len)
        for t in range(self.seq_len):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens[:, :-1], tokens[:, 1:]


def random_tokens(
    vocab_size: int, seq_len: int, batch_size: int, device: torch.device, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """Uniform random (inputs, targets) made on `device`: for timing, where content is moot."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), device=device, generator=gen)
    return tokens[:, :-1], tokens[:, 1:]
