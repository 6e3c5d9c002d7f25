"""The tiny models that the local-inference checks (tests/engine_llama, tests/engine_mlx, tests/engine_onnx) run in another engine, and
Transformers' answers they are held against: every position's float32 logits of fixed prompts, and greedy tokens.

`build` saves a random GatedQwen (GatedQwen-MoE with experts) whose norms, biases and constant gate logits are random
too; `train` fits one briefly to text, so that a perplexity says something (a random model's is about the vocabulary
size, whatever an engine or a quantization does to it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM

# Two layers, GQA, an untied output layer; head_dim 32 (Qwen3.5's RoPE sections fit), weights large enough
# (initializer_range 0.1) that greedy decoding does not repeat one token; 320 tokens: the tiny tokenizers' size.
SIZES = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
             initializer_range=0.1)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=48,
           norm_topk_prob=True)
PROMPTS = [[1, 5, 9, 20, 33], [7, 3, 3, 101, 64, 12, 90, 2, 45], [100, 22, 8, 17, 54, 31, 77, 6, 9, 60, 3, 11, 29, 250]]
NEW_TOKENS = 12
RTOL = 1e-3  # max |logit difference| <= RTOL * max(1, max |Transformers logit|), as `convert --verify`


def build(folder: Path, fields: dict, seed: int = 0) -> Path:
    """A saved random GatedQwen (GatedQwen-MoE with experts) of SIZES with `fields`, whose norms, biases and constant
    gate logits are random too (initialised as ones and zeros, they would hide a norm or bias written wrong)."""
    torch.manual_seed(seed)
    fields = {**SIZES, **fields}
    moe = "num_experts" in fields
    model = (GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**fields)) if moe
             else GatedQwenForCausalLM(GatedQwenConfig(**fields)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(("bias", "logits")):
                parameter.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


def transformers_answer(folder: Path, gated: bool = True, prompts: list[list[int]] = PROMPTS,
                        new_tokens: int = NEW_TOKENS) -> dict:
    """Transformers' float32 logits `[positions, vocab]` per prompt and greedy tokens (`generate`, its KV cache);
    with `gated=False`, the logits of the same weights without the gate (the ungated control)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if not gated:
        fields = {k: v for k, v in model.config.to_dict().items() if not k.startswith("gate_")}
        control = type(model)(type(model.config).from_dict({**fields, "gate_position": None})).eval()
        control.load_state_dict(model.state_dict(), strict=False)  # every tensor but the gate's
        model = control
    logits, greedy = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logits.append(model(ids).logits[0].numpy())
            if gated:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     do_sample=False, pad_token_id=0)
                greedy.append(out[0, len(prompt):].tolist())
    return {"logits": logits, "greedy": greedy}


def distance(logits: list, reference: list) -> float:
    """max |difference| / max(1, max |reference|) over every position of every prompt."""
    scale = max(1.0, max(float(np.abs(r).max()) for r in reference))
    return max(float(np.abs(np.asarray(a) - r).max()) for a, r in zip(logits, reference)) / scale


def train(folder: Path, text: str, fields: dict, steps: int = 150, seq_len: int = 64, seed: int = 0) -> Path:
    """A GatedQwen of SIZES with `fields`, trained `steps` AdamW steps on windows of `text` (tokenized by the
    tokenizer saved in `folder`, which it is saved beside), one thread."""
    from transformers import AutoTokenizer

    torch.manual_seed(seed)
    ids = torch.tensor(AutoTokenizer.from_pretrained(folder)(text).input_ids)
    model = GatedQwenForCausalLM(GatedQwenConfig(**{**SIZES, **fields}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len, (16,), generator=generator)
        batch = torch.stack([ids[s:s + seq_len] for s in starts.tolist()])
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    return folder


def windows(folder: Path, text: str, seq_len: int = 64) -> np.ndarray:
    """`text` tokenized by the tokenizer in `folder`, cut into consecutive windows `[N, seq_len]`."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(text).input_ids
    count = len(ids) // seq_len
    return np.array(ids[: count * seq_len]).reshape(count, seq_len)


def transformers_perplexity(folder: Path, data: np.ndarray) -> float:
    """exp(mean next-token cross-entropy) of the float32 model in `folder` over the windows `data`."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = torch.from_numpy(data)
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return float(loss.exp())
