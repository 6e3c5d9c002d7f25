"""Generation the way users run it: `pipeline("text-generation", model=folder)` and streaming with
`TextIteratorStreamer`, against a hand-written greedy loop (the full sequence re-run every step, no cache).

The folder holds a tiny model and a byte-level BPE tokenizer trained here with the `tokenizers` library."""

from threading import Thread

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, TextIteratorStreamer, pipeline

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from tests.helpers import TINY, sizes

TEXTS = [
    "the gate sits after attention and before the output projection",
    "a sigmoid gate on the attention output makes it sparse",
    "with the gate the attention sink goes away",
    "massive activations shrink when the gate is on",
]
PROMPT = "the gate sits"
NEW_TOKENS = 8


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2/Qwen style: spaces are part of the tokens) trained on TEXTS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A saved tiny model with its tokenizer; no end-of-sequence token, so every generation has NEW_TOKENS tokens."""
    folder = tmp_path_factory.mktemp("generation")
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    config = GatedQwenConfig(**sizes(TINY, vocab_size=len(tokenizer), tie_word_embeddings=False,
                                     pad_token_id=tokenizer.pad_token_id))
    GatedQwenForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """`ids: [1, S]` -> `[1, S + steps]`: argmax of the last position, the whole sequence re-run each step."""
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_id], dim=-1)
    return ids


def test_text_generation_pipeline_from_a_folder(folder):
    generator = pipeline("text-generation", model=str(folder))
    assert isinstance(generator.model, GatedQwenForCausalLM)
    (out,) = generator(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)

    tokenizer = generator.tokenizer
    expected = greedy(generator.model, tokenizer(PROMPT, return_tensors="pt").input_ids, NEW_TOKENS)
    assert out["generated_text"] == tokenizer.decode(expected[0])
    assert out["generated_text"].startswith(PROMPT) and len(expected[0]) == len(tokenizer(PROMPT).input_ids) + NEW_TOKENS


def test_text_iterator_streamer_yields_the_generation_piece_by_piece(folder):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    model = GatedQwenForCausalLM.from_pretrained(folder)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    kwargs = dict(**inputs, streamer=streamer, max_new_tokens=NEW_TOKENS, do_sample=False)
    thread = Thread(target=model.generate, kwargs=kwargs)
    thread.start()
    pieces = list(streamer)
    thread.join()

    expected = greedy(model, inputs.input_ids, NEW_TOKENS)[0, inputs.input_ids.shape[1]:]
    assert "".join(pieces) == tokenizer.decode(expected)
    assert len([p for p in pieces if p]) > 1  # streamed, not delivered at once
