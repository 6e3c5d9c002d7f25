"""The built-in corpus of `gated-qwen reproduce`: a synthetic language generated in-process (no download).

Every document starts with BOS (id 0), as pretraining sequences do, and continues with two kinds of text:
- a bigram chain: each token is followed by one of `successors` tokens (a fixed random table), uniformly, so the
  next token follows from the current one alone and attention has nothing to add;
- repeats: now and then a span of `span` tokens is copied verbatim from a uniformly chosen earlier position, so
  inside a repeat the continuation is in the context (far back, on long documents) and attention can find it.
  Repeats never start in a document's first `span[1]` tokens (there is little to copy from yet).
Heads that could serve the repeats have nothing to do where there can be none; in the paper's account an ungated
model then parks their attention on the first token (the attention sink) while a gated one can close its gate
instead. The demo's models do so mostly in those first tokens: see the README's analysis section.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BOS = 0
HELDOUT_SEED = 1_000_000  # documents drawn with this seed are never trained on


@dataclass(frozen=True)
class SyntheticLanguage:
    """A fixed random language over `vocab_size` ids (0 is BOS). `seed` fixes the bigram table; `sample` draws
    documents with its own seed. A repeat starts at a free position with probability `repeat_rate` (never in the
    first `span[1]` tokens) and copies `span[0]`..`span[1]` tokens."""

    vocab_size: int = 128
    successors: int = 8
    repeat_rate: float = 0.1
    span: tuple[int, int] = (8, 24)
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.successors < self.vocab_size:
            raise ValueError(f"`successors` must be in [1, vocab_size - 1 = {self.vocab_size - 1}], "
                             f"got {self.successors}.")
        if not 0 <= self.repeat_rate <= 1:
            raise ValueError(f"`repeat_rate` must be a probability in [0, 1], got {self.repeat_rate}.")
        if not 1 <= self.span[0] <= self.span[1]:
            raise ValueError(f"`span` must be (shortest, longest) with 1 <= shortest <= longest, got {self.span}.")

    def successor_table(self) -> torch.Tensor:
        """`[vocab_size, successors]`: the tokens that may follow each token (never BOS)."""
        g = torch.Generator().manual_seed(self.seed)
        return 1 + torch.stack([torch.randperm(self.vocab_size - 1, generator=g)[: self.successors]
                                for _ in range(self.vocab_size)])

    def sample(self, num_documents: int, length: int, seed: int = 0) -> torch.Tensor:
        """-> `[num_documents, length]` int64 documents; column 0 is BOS."""
        if num_documents < 1 or length < 2:
            raise ValueError(f"Need at least 1 document of at least 2 tokens, got {num_documents} x {length}.")
        table = self.successor_table()
        g = torch.Generator().manual_seed(seed)
        rows = torch.arange(num_documents)
        ids = torch.zeros(num_documents, length, dtype=torch.long)
        ids[:, 1] = 1 + torch.randint(self.vocab_size - 1, (num_documents,), generator=g)
        source = torch.zeros(num_documents, dtype=torch.long)  # where the current repeat copies from
        left = torch.zeros(num_documents, dtype=torch.long)  # tokens the current repeat still copies
        for i in range(2, length):
            pick = torch.randint(self.successors, (num_documents,), generator=g)
            token = table[ids[:, i - 1], pick]
            start = (left == 0) & (torch.rand(num_documents, generator=g) < self.repeat_rate) & (i > self.span[1])
            span = torch.randint(self.span[0], self.span[1] + 1, (num_documents,), generator=g)
            origin = torch.randint(1, i, (num_documents,), generator=g)  # an earlier token, never BOS
            source = torch.where(start, origin, source)
            left = torch.where(start, span, left)
            repeating = left > 0
            token = torch.where(repeating, ids[rows, source], token)
            source, left = source + repeating.long(), left - repeating.long()
            ids[:, i] = token
        return ids
