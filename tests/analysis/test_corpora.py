"""The built-in corpora against their own rules, token by token."""

import pytest
import torch

from gated_qwen.analysis import SyntheticLanguage
from gated_qwen.analysis.miniature.corpora import HELDOUT_SEED, BigramBackcopy, KeyValueRecall


@pytest.mark.parametrize("layout", ["halves", "interleaved"])
def test_key_value_recall_follows_its_rules(layout):
    corpus = KeyValueRecall(fillers=20, keys=6, values=5, tokens_per_fact=10, successors=4, layout=layout, seed=2)
    assert corpus.vocab_size == 1 + 20 + 6 + 5 + 30
    table = corpus.successor_table()
    assert table.shape == (corpus.vocab_size, 4) and (table >= 1).all() and (table <= 20).all()
    # 1 fact in the shortest document (halves: a position in [1, n // 2) and a query slot after; interleaved: two
    # two-token slots), 6 facts (one per key) in 69 tokens
    assert (corpus.min_length(), corpus.max_length()) == ((5, 69) if layout == "halves" else (6, 69))
    for length, facts in ((corpus.min_length(), 1), (30, 3), (69, 6)):  # the facts scale with the length
        assert corpus.facts(length) == facts
        docs = corpus.sample(40, length, seed=7)
        assert torch.equal(docs, corpus.sample(40, length, seed=7))
        half = length // 2
        for doc, targets in zip(docs.tolist(), corpus.recall_targets(docs).tolist()):
            assert doc[0] == 0
            known = {}  # key -> (value, position), from the fact tokens
            for i, token in enumerate(doc[1:], start=1):
                if token > 1 + 20 + 6 + 5 - 1:  # a fact token
                    assert i < half if layout == "halves" else i % 2 == 1
                    key, value = divmod(token - 32, 5)
                    assert key not in known
                    known[key] = value, i
            assert len(known) == facts
            queried = []
            for i in range(1, length):
                token, before = doc[i], doc[i - 1]
                if 21 <= before <= 26:  # after a key: its fact's value
                    assert token == 27 + known[before - 21][0] and targets[i]
                    continue
                assert not targets[i]
                if 21 <= token <= 26:  # a query's key: after its fact (halves: in the second half), each fact's once
                    assert (half <= i if layout == "halves" else i % 2 == 1) and known[token - 21][1] < i < length - 1
                    queried.append(token - 21)
                elif token <= 20:
                    assert i == 1 or token in table[before].tolist()  # the chain goes on from any token
            assert sorted(queried) == sorted(known)
    with pytest.raises(ValueError, match=f"give at least {corpus.min_length()} tokens"):
        corpus.sample(2, corpus.min_length() - 1)
    with pytest.raises(ValueError, match="7 facts .* more than its 6 distinct keys; give at most 69 tokens"):
        corpus.sample(2, 70)
    with pytest.raises(ValueError, match="tokens_per_fact"):
        KeyValueRecall(tokens_per_fact=4)
    with pytest.raises(ValueError, match="layout"):
        KeyValueRecall(layout="random")


def test_held_out_documents_of_the_chain_corpora_are_prefixes_of_longer_ones():
    """`reproduce.held_out(preset, length)` draws each length anew: for these corpora that is the first tokens of the
    longest documents, so every length sees the same documents."""
    for corpus in (BigramBackcopy(), SyntheticLanguage()):
        assert torch.equal(corpus.sample(5, 30, seed=HELDOUT_SEED), corpus.sample(5, 240, seed=HELDOUT_SEED)[:, :30])


def test_builtin_corpus_follows_its_rules():
    language = SyntheticLanguage(vocab_size=50, successors=3, repeat_rate=0.2, span=(4, 6), seed=3)
    docs = language.sample(64, 80, seed=5)
    assert torch.equal(docs, language.sample(64, 80, seed=5))
    assert not torch.equal(docs, language.sample(64, 80, seed=6))
    assert (docs[:, 0] == 0).all() and (docs[:, 1:] > 0).all() and docs.max() < 50
    table = language.successor_table()
    follows = (table[docs[:, 1:-1]] == docs[:, 2:, None]).any(-1)  # [N, S-2]: a bigram step
    assert follows[:, : 6 - 1].all()  # no repeat starts in the first span[1] tokens
    for doc, ok in zip(docs, follows):
        for i in (~ok).nonzero().flatten().tolist():  # every other token is copied from earlier in the document
            position = i + 2
            assert (doc[1:position] == doc[position]).any()
    off_table = 1 - follows.float().mean().item()
    assert 0.05 < off_table < 0.6  # repeats happen, but the chain dominates
    with pytest.raises(ValueError, match="successors"):
        SyntheticLanguage(vocab_size=4, successors=4)


def test_bigram_backcopy_follows_its_rules():
    language = BigramBackcopy(vocab_size=30, triggers=3, successors=4, trigger_rate=0.4, seed=2)
    docs = language.sample(200, 50, seed=7)
    assert torch.equal(docs, language.sample(200, 50, seed=7))
    assert not torch.equal(docs, language.sample(200, 50, seed=8))
    table = language.successor_table()
    assert table.shape == (30, 4) and (table > 3).all() and table.max() < 30  # successors are ordinary tokens
    triggers = 0
    for doc in docs.tolist():  # the rules, token by token
        assert doc[0] == 0 and doc[1] > 3
        for i in range(2, len(doc)):
            if 1 <= doc[i - 1] <= 3:
                assert doc[i] == doc[i - 2] and doc[i] > 3  # the backcopy: an ordinary token
            else:
                assert 1 <= doc[i] <= 3 or doc[i] in table[doc[i - 1]].tolist()
            triggers += 1 <= doc[i] <= 3
    share = triggers / (200 * 48)
    assert share == pytest.approx(0.4 / 1.4, abs=0.02)  # a trigger after each ordinary token with p = 0.4
    assert torch.equal(language.is_trigger(docs), (docs >= 1) & (docs <= 3))
    with pytest.raises(ValueError, match="trigger_rate"):
        BigramBackcopy(trigger_rate=1.5)
    with pytest.raises(ValueError, match="successors"):
        BigramBackcopy(vocab_size=10, triggers=4, successors=6)
