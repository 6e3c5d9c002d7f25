"""Perplexity against a hand-written cross-entropy, YaRN against a model built from a YaRN config and its bands
against the YaRN paper's formula, recall accuracy against a count."""

import math

import pytest
import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.analysis import mean_nll, perplexity_by_length
from gated_qwen.analysis.miniature.corpora import KeyValueRecall
from gated_qwen.analysis.perplexity import recall_accuracy, with_yarn
from tests.analysis.analysis_helpers import ids, model_for
from tests.helpers import TINY, sizes


def test_perplexity_matches_a_hand_computation_and_yarn_a_model_built_from_a_yarn_config():
    model = model_for()
    x = ids(batch=5, length=40)
    with torch.no_grad():
        logp = model(x).logits.log_softmax(-1)
    by_hand = -logp[:, :-1].gather(-1, x[:, 1:, None]).mean().item()
    assert mean_nll(model, x, batch_size=2) == pytest.approx(by_hand, rel=1e-10)

    yarn = with_yarn(model, 4.0)
    config = GatedQwenConfig(**{**model.config.to_dict(), "max_position_embeddings": 256,
                                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64}})
    reference = GatedQwenForCausalLM(config).double().eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(yarn(x).logits, reference(x).logits, rtol=0, atol=1e-10)
        assert not torch.allclose(yarn(x).logits, model(x).logits)  # YaRN changed something ...
    assert model.config.rope_parameters["rope_type"] == "default"  # ... in a copy only

    rows = perplexity_by_length(model, lambda n: x[:, :n], [20, 40], yarn_factor=4.0, batch_size=3)
    assert [r["length"] for r in rows] == [20, 40] and rows[1]["sequences"] == 5
    assert rows[0]["ppl"] == pytest.approx(math.exp(mean_nll(model, x[:, :20])), rel=1e-10)
    assert rows[1]["ppl_yarn"] == pytest.approx(math.exp(mean_nll(reference, x)), rel=1e-10)
    with pytest.raises(ValueError, match="factor"):
        with_yarn(model, 1.0)


class _LookupModel(torch.nn.Module):
    """Next-token logits from the current token alone (`table[token]`), as a causal LM returns them."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table[input_ids])


def test_recall_accuracy_matches_a_count():
    corpus = KeyValueRecall()
    docs = corpus.sample(50, 40, seed=3)
    targets = corpus.recall_targets(docs)
    table = torch.randn(corpus.vocab_size, corpus.vocab_size, generator=torch.Generator().manual_seed(0))
    for key in range(corpus.keys):  # after key k, the most likely token is value k % values: right 1 time in `values`
        table[1 + corpus.fillers + key, 1 + corpus.fillers + corpus.keys + key % corpus.values] += 10
    model = _LookupModel(table)
    hits = positions = 0
    nll = 0.0
    for doc in docs.tolist():
        for i in range(1, len(doc)):
            if corpus.fillers < doc[i - 1] <= corpus.fillers + corpus.keys:  # a key: a value to recall follows
                logits = table[doc[i - 1]]
                hits += int(logits.argmax()) == doc[i]
                nll -= logits.log_softmax(-1)[doc[i]].item()
                positions += 1
    assert positions == 50 * corpus.facts(40) == 250 and 0 < hits < positions
    result = recall_accuracy(model, docs, targets, batch_size=7)
    assert result == {"accuracy": hits / positions, "nll": pytest.approx(nll / positions, rel=1e-6),
                      "positions": positions}
    with pytest.raises(ValueError, match="position 0"):
        recall_accuracy(model, docs, torch.ones_like(targets))


@pytest.mark.parametrize("length, theta, head_dim, unchanged, interpolated_from", [
    (32, 1e4, 64, [0], 6),  # the old long-context model: only frequency 0 kept, and only by rounding (5 turns)
    (256, 1e4, 128, [0, 1], 26),  # the long-context model: frequencies 0 and 1 turn 41 and 35 times in 256 tokens
])
def test_yarn_bands_match_the_yarn_papers_formula(length, theta, head_dim, unchanged, interpolated_from):
    """YaRN (Peng et al. 2023) with beta_fast 32 and beta_slow 1: a frequency that turns r times in the trained
    context is left alone where r >= 32 and divided by the factor where r <= 1; Transformers rounds the band edges
    (the dimension index where r crosses each bound, down and up) and ramps linearly between."""
    from gated_qwen.analysis.perplexity import yarn_bands

    config = GatedQwenConfig(**sizes(TINY, head_dim=head_dim, max_position_embeddings=length,
                                     rope_parameters={"rope_type": "default", "rope_theta": theta}))
    bands = yarn_bands(config, 4.0)
    turns = [length * theta ** (-2 * i / head_dim) / (2 * math.pi) for i in range(head_dim // 2)]
    edge = lambda r: head_dim * math.log(length / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(edge(32)), 0), math.ceil(edge(1))
    assert bands["rotations"] == pytest.approx(turns)
    assert bands["unchanged"] == list(range(low + 1)) == unchanged
    assert bands["interpolated"] == list(range(high, head_dim // 2)) and high == interpolated_from
    assert bands["ramp"] == list(range(low + 1, high))
    assert all(turns[i] >= 32 for i in bands["unchanged"] if length >= 256)
    assert bands["attention_factor"] == pytest.approx(0.1 * math.log(4.0) + 1)
