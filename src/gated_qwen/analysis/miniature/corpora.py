"""The built-in corpora of `gated-qwen reproduce`: synthetic languages generated in-process (no download).

`BigramBackcopy` (the default) is the Bigram-Backcopy task of Guo et al. 2024 ("Active-dormant attention heads",
arXiv 2410.13835): a bigram chain in which a few trigger tokens are followed by a copy of the token before the
trigger. Predicting a copy needs attention (to the previous token); predicting anything else does not, so a head
that serves the copies is dormant at every other position, throughout the sequence. Without a gate, a dormant
head has to put its attention somewhere harmless: on the first token (the attention sink), whose value it can
make small; the paper's G1 gate lets it close instead.

`SyntheticLanguage` (`--corpus repeats`) is a bigram chain in which spans are now and then copied from far back,
from position `span[1]` on: heads have lookups to do from there, so sinks form mostly in the first tokens.

`KeyValueRecall` (`--corpus recall`, the long-context model's) is a bigram chain with a few facts, each one token
for a (key, value) pair, in the first half of a document, and in the second half each fact's query: its key, then
its value. The value can only be known by finding the fact, which lies up to the whole document back; everywhere
else the head has nothing to retrieve. Evaluated at several times the training length, it asks what the paper's
RULER numbers ask: whether a model still finds what lies far back.

Every document starts with BOS (id 0), as pretraining sequences do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BOS = 0
HELDOUT_SEED = 1_000_000  # documents drawn with this seed are never trained on


@dataclass(frozen=True)
class BigramBackcopy:
    """Guo et al. 2024's Bigram-Backcopy task over `vocab_size` ids: 0 is BOS, `1..triggers` are the trigger
    tokens, the rest are ordinary tokens. `seed` fixes the bigram table; `sample` draws documents with its own seed.

    A document is BOS, an ordinary token, then, for each next token:
    - after a trigger: a copy of the token before the trigger (the backcopy);
    - otherwise: a trigger (uniformly chosen) with probability `trigger_rate`, else one of the `successors`
      ordinary tokens that may follow the current one (a fixed random table), uniformly.
    The token before a trigger is always ordinary, so copies are ordinary tokens and triggers never follow each
    other; in the long run a share `trigger_rate / (1 + trigger_rate)` of the tokens are triggers."""

    vocab_size: int = 64
    triggers: int = 4
    successors: int = 8
    trigger_rate: float = 0.4
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.triggers <= self.vocab_size - 3:
            raise ValueError(f"`triggers` must be in [1, vocab_size - 3 = {self.vocab_size - 3}] (BOS and two "
                             f"ordinary tokens at least), got {self.triggers}.")
        ordinary = self.vocab_size - 1 - self.triggers
        if not 1 <= self.successors <= ordinary:
            raise ValueError(f"`successors` must be in [1, ordinary tokens = {ordinary}], got {self.successors}.")
        if not 0 <= self.trigger_rate <= 1:
            raise ValueError(f"`trigger_rate` must be a probability in [0, 1], got {self.trigger_rate}.")

    def is_trigger(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids: [...]` -> bool `[...]`: which tokens are triggers."""
        return (ids >= 1) & (ids <= self.triggers)

    def successor_table(self) -> torch.Tensor:
        """`[vocab_size, successors]`: the ordinary tokens that may follow each token."""
        g = torch.Generator().manual_seed(self.seed)
        ordinary = self.vocab_size - 1 - self.triggers
        return 1 + self.triggers + torch.stack([torch.randperm(ordinary, generator=g)[: self.successors]
                                                for _ in range(self.vocab_size)])

    def sample(self, num_documents: int, length: int, seed: int = 0) -> torch.Tensor:
        """-> `[num_documents, length]` int64 documents; column 0 is BOS."""
        if num_documents < 1 or length < 2:
            raise ValueError(f"Need at least 1 document of at least 2 tokens, got {num_documents} x {length}.")
        table = self.successor_table()
        g = torch.Generator().manual_seed(seed)
        ordinary = self.vocab_size - 1 - self.triggers
        ids = torch.zeros(num_documents, length, dtype=torch.long)
        ids[:, 1] = 1 + self.triggers + torch.randint(ordinary, (num_documents,), generator=g)
        for i in range(2, length):
            pick = torch.randint(self.successors, (num_documents,), generator=g)
            trigger = 1 + torch.randint(self.triggers, (num_documents,), generator=g)
            fire = torch.rand(num_documents, generator=g) < self.trigger_rate
            token = torch.where(fire, trigger, table[ids[:, i - 1], pick])
            ids[:, i] = torch.where(self.is_trigger(ids[:, i - 1]), ids[:, i - 2], token)
        return ids


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


@dataclass(frozen=True)
class KeyValueRecall:
    """Facts recalled from far back, over a bigram chain. Ids: 0 is BOS, then `fillers` ordinary tokens, `keys` key
    tokens, `values` value tokens, and one fact token for every (key, value) pair (`fact_token`). `seed` fixes the
    bigram table; `sample` draws documents with its own seed.

    A document of length n is BOS and a bigram chain (each token followed by one of `successors` ordinary tokens,
    a fixed random table over every token, uniformly), into which are written `facts(n)` = n // `tokens_per_fact`
    fact tokens (the facts scale with the length: a document twice as long holds twice as many) with distinct keys
    and uniformly drawn values, and one query per fact: the fact's key, then its value. The chain goes on after each
    written token from that token. `layout` says where they go:
    - "halves": the facts at distinct random positions of [1, n // 2), the queries in random order at random
      non-overlapping places of [n // 2, n - 1);
    - "interleaved": facts and queries anywhere in [1, n - 1), each query after its fact (two-token slots at odd
      positions, drawn at random and paired at random, the earlier of a pair the fact's), so that queries come at
      every position and their facts at every distance behind them.
    A value after a key (`recall_targets`) can only be predicted by finding the key's fact, 1 to n - 2 tokens back;
    it is one of `values` equally likely tokens without it. A length needs room for its facts: at most `keys` of
    them, and a place for each and its query (`check_length`)."""

    fillers: int = 32
    keys: int = 8
    values: int = 8
    tokens_per_fact: int = 8
    successors: int = 8
    layout: str = "halves"
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.successors <= self.fillers:
            raise ValueError(f"`successors` must be in [1, fillers = {self.fillers}], got {self.successors}.")
        if self.keys < 1 or self.values < 1:
            raise ValueError(f"`keys` and `values` must be at least 1, got {self.keys} and {self.values}.")
        if self.layout not in ("halves", "interleaved"):
            raise ValueError(f"`layout` must be 'halves' or 'interleaved', got {self.layout!r}.")
        if self.tokens_per_fact < 5:
            raise ValueError(f"`tokens_per_fact` must be at least 5 (a fact in the first half and its query's two "
                             f"tokens in the second), got {self.tokens_per_fact}.")

    @property
    def vocab_size(self) -> int:
        return 1 + self.fillers + self.keys + self.values + self.keys * self.values

    def facts(self, length: int) -> int:
        """How many facts a document of `length` tokens holds (at least one)."""
        return max(1, length // self.tokens_per_fact)

    def check_length(self, length: int) -> None:
        """Raises a `ValueError` unless a document of `length` tokens has room for its facts: distinct keys (at most
        `keys` facts), a position for each in the first half and a query slot for each in the second."""
        facts = self.facts(length)
        if not self._has_room(length):
            raise ValueError(f"A KeyValueRecall document of {length} tokens has no room for its {facts} fact(s) "
                             f"and their queries; give at least {self.min_length()} tokens.")
        if facts > self.keys:
            raise ValueError(f"A KeyValueRecall document of {length} tokens holds {facts} facts (one per "
                             f"{self.tokens_per_fact} tokens), more than its {self.keys} distinct keys; give at most "
                             f"{self.max_length()} tokens.")

    def min_length(self) -> int:
        """The shortest document with room for its facts (first half) and their queries (second half)."""
        return next(n for n in range(4, 4 * self.tokens_per_fact + 8) if self._has_room(n))

    def _has_room(self, n: int) -> bool:
        if self.layout == "interleaved":  # a two-token slot for each fact and each query
            return n >= 4 and 2 * self.facts(n) <= (n - 2) // 2
        return n >= 4 and self.facts(n) <= min(n // 2 - 1, (n - 1 - n // 2) // 2)

    def max_length(self) -> int:
        """The longest document whose facts have distinct keys."""
        return (self.keys + 1) * self.tokens_per_fact - 1

    def key_token(self, key: torch.Tensor) -> torch.Tensor:
        return 1 + self.fillers + key

    def value_token(self, value: torch.Tensor) -> torch.Tensor:
        return 1 + self.fillers + self.keys + value

    def fact_token(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return 1 + self.fillers + self.keys + self.values + key * self.values + value

    def is_key(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids: [...]` -> bool `[...]`: which tokens are keys (in this corpus, only queries hold them)."""
        return (ids > self.fillers) & (ids <= self.fillers + self.keys)

    def recall_targets(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids: [N, S]` -> bool `[N, S]`: the positions that need recall (a value right after a key)."""
        targets = torch.zeros_like(ids, dtype=torch.bool)
        targets[:, 1:] = self.is_key(ids[:, :-1])
        return targets

    def successor_table(self) -> torch.Tensor:
        """`[vocab_size, successors]`: the ordinary tokens that may follow each token."""
        g = torch.Generator().manual_seed(self.seed)
        return 1 + torch.stack([torch.randperm(self.fillers, generator=g)[: self.successors]
                                for _ in range(self.vocab_size)])

    def sample(self, num_documents: int, length: int, seed: int = 0) -> torch.Tensor:
        """-> `[num_documents, length]` int64 documents; column 0 is BOS."""
        if num_documents < 1:
            raise ValueError(f"Need at least 1 document, got {num_documents}.")
        self.check_length(length)
        table = self.successor_table()
        g = torch.Generator().manual_seed(seed)
        n, half, facts = num_documents, length // 2, self.facts(length)
        rows = torch.arange(n)[:, None]
        written = torch.full((n, length), -1, dtype=torch.long)  # -1: the chain's token goes there
        keys = torch.rand(n, self.keys, generator=g).argsort(-1)[:, :facts]  # [n, facts], distinct
        values = torch.randint(self.values, (n, facts), generator=g)
        if self.layout == "interleaved":  # 2 * facts slots (1 + 2j, 2 + 2j), paired at random: (fact, its query)
            chosen = 1 + 2 * torch.rand(n, (length - 2) // 2, generator=g).argsort(-1)[:, : 2 * facts]
            fact_at = torch.minimum(chosen[:, 0::2], chosen[:, 1::2])
            query_at = torch.maximum(chosen[:, 0::2], chosen[:, 1::2])
        else:
            fact_at = 1 + torch.rand(n, half - 1, generator=g).argsort(-1)[:, :facts]
            slots = (length - 1 - half) // 2  # query slots: (key, value) at half + 2j, half + 2j + 1
            query_at = half + 2 * torch.rand(n, slots, generator=g).argsort(-1)[:, :facts]
        written[rows, fact_at] = self.fact_token(keys, values)
        written[rows, query_at] = self.key_token(keys)
        written[rows, query_at + 1] = self.value_token(values)
        ids = torch.zeros(n, length, dtype=torch.long)
        for i in range(1, length):
            pick = torch.randint(self.successors, (n,), generator=g)
            ids[:, i] = torch.where(written[:, i] >= 0, written[:, i], table[ids[:, i - 1], pick])
        return ids


@dataclass(frozen=True)
class TrigramLanguage:
    """A random second-order Markov chain over `vocab_size` ids (0 is BOS): after BOS and a uniformly drawn first
    token, each token is one of the `successors` tokens that may follow the two before it (a fixed random table over
    every pair, never BOS), uniformly. `seed` fixes the table; `sample` draws documents with its own seed.

    Its entropy is known exactly (`entropy_floor`): log(vocab_size - 1) for the first token, log(successors) for every
    later one. A model that has learned the table reaches that floor; a tiny model cannot hold a table of
    `vocab_size`² contexts in a short training, so its held-out loss stays above the floor, and how far above is
    what a better architecture can win (table 1's perplexity ranking, in miniature). Predicting a token needs the one
    two back, which only attention brings."""

    vocab_size: int = 64
    successors: int = 4
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.successors < self.vocab_size:
            raise ValueError(f"`successors` must be in [1, vocab_size - 1 = {self.vocab_size - 1}], "
                             f"got {self.successors}.")

    def successor_table(self) -> torch.Tensor:
        """`[vocab_size, vocab_size, successors]`: the tokens that may follow each pair (distinct, never BOS)."""
        g = torch.Generator().manual_seed(self.seed)
        v = self.vocab_size
        return 1 + torch.rand(v, v, v - 1, generator=g).argsort(-1)[..., : self.successors]

    def entropy_floor(self, length: int) -> float:
        """The corpus's mean next-token entropy (nats) over positions 1..length-1 of a document: the least held-out
        loss any model can reach."""
        return (math.log(self.vocab_size - 1) + (length - 2) * math.log(self.successors)) / (length - 1)

    def sample(self, num_documents: int, length: int, seed: int = 0) -> torch.Tensor:
        """-> `[num_documents, length]` int64 documents; column 0 is BOS."""
        if num_documents < 1 or length < 2:
            raise ValueError(f"Need at least 1 document of at least 2 tokens, got {num_documents} x {length}.")
        table = self.successor_table()
        g = torch.Generator().manual_seed(seed)
        ids = torch.zeros(num_documents, length, dtype=torch.long)
        ids[:, 1] = 1 + torch.randint(self.vocab_size - 1, (num_documents,), generator=g)
        for i in range(2, length):
            pick = torch.randint(self.successors, (num_documents,), generator=g)
            ids[:, i] = table[ids[:, i - 2], ids[:, i - 1], pick]
        return ids


CORPORA = {"bigram-backcopy": BigramBackcopy, "repeats": SyntheticLanguage,  # `reproduce --corpus NAME`
           "recall": KeyValueRecall, "trigram": TrigramLanguage}
