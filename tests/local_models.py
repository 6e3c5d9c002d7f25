"""The tiny models that the local-inference checks (tests/engine_llama, tests/engine_mlx, tests/engine_onnx) run in another engine, and
Transformers' answers they are held against: every position's float32 logits of fixed prompts, and greedy tokens;
`parity_test`, the check each of those folders makes with its engine.

`build` saves a random GatedQwen (GatedQwen-MoE with experts) whose norms, biases and constant gate logits are random
too; `train` fits one briefly to text, so that a perplexity says something (a random model's is about the vocabulary
size, whatever an engine or a quantization does to it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from gated_qwen.conversion import convert
from tests.helpers import SMALL, sizes

# Two layers, GQA, an untied output layer; head_dim 32 (Qwen3.5's RoPE sections fit), weights large enough
# (initializer_range 0.1) that greedy decoding does not repeat one token; 320 tokens: the tiny tokenizers' size.
SIZES = sizes(SMALL, vocab_size=320, head_dim=32, initializer_range=0.1)
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


def parity_test(engine: str, to: str, cases: dict[str, dict], run: Callable[[Path], dict], tokenizer: bool = False,
                expected_greedy: Callable[[dict, dict], list] = lambda ran, reference: reference["greedy"],
                also: Callable[[dict, dict], None] = lambda case, ran: None):
    """The engine-parity check of one engine, as the module fixture `cases` and the test, which the engine's test
    module binds to its own names (`cases, test_... = parity_test(...)`).

    `cases`: name -> config fields besides SIZES. For each, a random model (`build`; with a tiny tokenizer beside it
    when the engine reads one, `tokenizer`) is converted with `convert(to_format=to)`, and the fixture holds
    name -> {"folder", "converted", "transformers": its answer, "control": the answer without the gate (None for a
    model without one)}. The test, parametrised by the names: `run(converted)` returns the engine's
    {"logits": [[positions, vocab] per prompt], "greedy": [tokens per prompt]}; every logit within RTOL of
    Transformers' (`distance`), the greedy tokens `expected_greedy(ran, transformers)` (Transformers' by default),
    and each gated model's logits, the engine's and Transformers' alike, farther than RTOL from the control's (the
    comparison sees the gate); then `also(case, ran)`, the engine's own further checks."""
    @pytest.fixture(scope="module", name="cases")
    def built(tmp_path_factory) -> dict:
        root = tmp_path_factory.mktemp(f"{to}-models")
        out = {}
        for name, fields in cases.items():
            folder = build(root / name, fields)
            if tokenizer:
                from tests.helpers import tiny_tokenizer

                tiny_tokenizer(folder, vocab_size=SIZES["vocab_size"])
            converted = root / (f"{name}.gguf" if to == "gguf" else f"{name}-{to}")  # a file, or a folder
            convert(folder, converted, to_format=to)
            gated = fields.get("gate_position", "sdpa") is not None
            out[name] = {"folder": folder, "converted": converted, "transformers": transformers_answer(folder),
                         "control": transformers_answer(folder, gated=False) if gated else None}
        return out

    @pytest.mark.parametrize("name", cases)
    def test(cases, name):
        case = cases[name]
        ran, reference = run(case["converted"]), case["transformers"]
        error = distance(ran["logits"], reference["logits"])
        print(f"{engine}, {name}: max |logit difference| {error:.3g} (relative), greedy {ran['greedy'][0]}")
        assert error <= RTOL, f"{name}: {engine}'s logits are {error:.3g} from Transformers' (tolerance {RTOL})"
        assert ran["greedy"] == expected_greedy(ran, reference)
        if case["control"] is not None:
            away = distance(case["control"]["logits"], reference["logits"])
            assert distance(ran["logits"], case["control"]["logits"]) > RTOL and away > RTOL, (name, away)
        also(case, ran)

    return built, test
