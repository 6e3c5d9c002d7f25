"""The compatibility seam (`gated_qwen/transformers_compat.py`): each name it chooses does, under the installed
Transformers, what the model files need. `make test` runs this under the lock's 5.24, `make test-serving` under
5.19 (vLLM's pin), and tests/serving/test_shipped_files.py runs the saved model files under each version met.

References are independent of the seam: hand-written slices and masks, the registry Transformers' tensor
parallelism reads, and generation without a cache."""

import torch
from helpers import SMALL, randomize_

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen import transformers_compat as compat


def test_slice_logits_to_keep_keeps_the_last_positions_or_the_given_ones():
    hidden = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    assert torch.equal(compat.slice_logits_to_keep(hidden, 0), hidden)
    assert torch.equal(compat.slice_logits_to_keep(hidden, 2), hidden[:, 3:])
    assert torch.equal(compat.slice_logits_to_keep(hidden, torch.tensor([0, 4])), hidden[:, [0, 4]])


def test_causal_mask_takes_the_cache_and_masks_padding_and_the_future():
    config = GatedQwenConfig(**SMALL)
    config._attn_implementation = "eager"
    padding = torch.tensor([[0, 1, 1, 1]])
    mask = compat.create_causal_mask(config=config, inputs_embeds=torch.zeros(1, 4, SMALL["hidden_size"]),
                                     attention_mask=padding, cache=None, position_ids=torch.arange(4)[None])
    allowed = torch.tril(torch.ones(4, 4, dtype=torch.bool)) & padding.bool()  # query i sees keys j <= i, not padding
    assert torch.equal(mask[0, 0] == 0, allowed)


def test_generation_with_the_cache_matches_generation_without_it():
    # The causal LM hands its cache back under CACHE_FIELD; under a wrong name `generate` would lose it.
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**SMALL)), seed=3, scale=0.3).eval()
    prompt = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
        recomputed = model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
        output = model(prompt, use_cache=True)
    assert torch.equal(cached, recomputed)
    assert output[compat.CACHE_FIELD].get_seq_length() == prompt.shape[1]


def test_head_shared_gate_style_is_in_the_registry_tensor_parallelism_reads():
    from transformers.distributed import tensor_parallel

    assert compat.ALL_PARALLEL_STYLES is tensor_parallel.ALL_PARALLEL_STYLES
    assert "head_shared_gate" in tensor_parallel.ALL_PARALLEL_STYLES
