"""The conversion tests' shared sources: stock Qwen3 checkpoints and a gated_qwen folder, built once per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
)

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.conversion.conversion_helpers import TINY, logits, randomize_


@pytest.fixture(scope="module")
def qwen3_sources(tmp_path_factory):
    """Stock Qwen3 checkpoints (without and with attention_bias; the first saved in several shards) and their
    logits."""
    root = tmp_path_factory.mktemp("qwen3")
    out = {}
    for bias in (False, True):
        model = randomize_(Qwen3ForCausalLM(Qwen3Config(**TINY, attention_bias=bias, tie_word_embeddings=False)))
        model.save_pretrained(root / f"bias{bias}", max_shard_size="40KB")
        out[bias] = (root / f"bias{bias}", logits(model))
    return out


@pytest.fixture(scope="module")
def gated_source(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gated") / "g"
    randomize_(GatedQwenForCausalLM(GatedQwenConfig(**TINY))).save_pretrained(folder)
    return folder


