"""Builds the tiny models that tests/serving serves with vLLM, and Transformers' answers for them.

Run by tests/serving/conftest.py with the project's own environment (`.venv`, the lock's Transformers 5.24), not the
serving one: this is what a user has who trains with gated-qwen and then serves. For each case it writes a folder
(a native gated_qwen folder, saved with `save_pretrained`, or an export written by `gated_qwen.convert`) and records,
for every prompt of `PROMPTS`, Transformers' greedy continuation and the log-probability of each chosen token in
float32, computed with the classes a user would load the folder with: `GatedQwen*ForCausalLM` for a native folder,
stock `Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` for an export. It also records the same for the control: the
same weights with the gate removed (for an export, its source's), which vLLM's answer must not match. The exports
`gated-qwen convert` refuses (`cases.REFUSED`) are written anyway, to show what vLLM does with them.

usage: python -m tests.serving.build_models OUT [CASE ...]   ->   OUT/CASE/ (the folder), OUT/manifest.json
"""

import json
import sys
from pathlib import Path

import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM  # noqa: E402
from gated_qwen.conversion import convert  # noqa: E402
from tests.helpers import TINY_MOE, randomize_  # noqa: E402
from tests.serving.cases import MOE, NEW_TOKENS, PROMPTS, REFUSED, SERVING  # noqa: E402
from tests.serving.transformers_answers import greedy  # noqa: E402
from tests.serving.variants import EXPORTS, NATIVE  # noqa: E402


def build(name: str) -> torch.nn.Module:
    """The model of a native case, with random weights that make its gate matter (norms included)."""
    if name in MOE:
        config = GatedQwenMoeConfig(**SERVING, **TINY_MOE, **MOE[name])
        model = GatedQwenMoeForCausalLM(config)
    else:
        model = GatedQwenForCausalLM(GatedQwenConfig(**SERVING, **NATIVE[name]))
    seed = sorted([*NATIVE, *MOE]).index(name)
    randomize_(model, seed=seed, scale=0.25)
    with torch.no_grad():  # gate logits of a few units, so the scores spread over (0, 1)
        for param_name, param in model.named_parameters():
            if ".gate." in param_name and "mlp" not in param_name:
                param.mul_(4.0)
    return model.eval()


def without_gate(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in the same architecture with no gate (the control vLLM must not match)."""
    fields = {k: v for k, v in model.config.to_dict().items() if not k.startswith(("gate_", "sdpa_output"))}
    fields.pop("auto_map", None)
    config = type(model.config).from_dict({**fields, "gate_position": None})
    control = type(model)(config).eval()
    missing, unexpected = control.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(".gate." in k for k in unexpected), (missing, unexpected)
    return control


def save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer whose token `i` is the word `t{i}` (what the OpenAI server needs to answer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(SERVING["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t0").save_pretrained(folder)


def main(out: Path, cases: list[str]) -> None:
    torch.manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {}
    natives = {}
    sources = [EXPORTS[c][0] for c in cases if c in EXPORTS] + [REFUSED[c][0] for c in cases if REFUSED.get(c, [0])[0]]
    for name in [c for c in cases if c in NATIVE or c in MOE] + sources:
        if name in natives:
            continue
        model = build(name)
        model.save_pretrained(out / name)
        natives[name] = model
        control = greedy(without_gate(model)) if model.config.gate_position or model.config.sdpa_output_transform \
            else None
        manifest[name] = {"folder": name, "kind": "native", "source": name, "reference": greedy(model),
                          "control": control, "moe": name in MOE}
    for name in [c for c in cases if c in EXPORTS]:
        source, fmt = EXPORTS[name]
        convert(out / source, out / name, to_format=fmt)
        from transformers import AutoModelForCausalLM

        stock = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval()
        assert type(stock).__module__.startswith("transformers.models."), type(stock)  # stock, not gated_qwen
        manifest[name] = {"folder": name, "kind": fmt, "source": source, "reference": greedy(stock),
                          "control": manifest[source]["control"], "moe": source in MOE}
    for name in [c for c in cases if c in REFUSED]:
        source, fmt = REFUSED[name]
        if source is None:  # what vLLM's Qwen3-Next refuses: no sparse layer
            from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

            config = Qwen3NextConfig(**SERVING, layer_types=["full_attention"] * SERVING["num_hidden_layers"],
                                     num_experts=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 1.0})
            stock = randomize_(Qwen3NextForCausalLM(config), seed=1, norm_center=0.0).eval()
            stock.save_pretrained(out / name)
        else:
            convert(out / source, out / name, to_format=fmt, allow_o_proj_bias=True)
            from transformers import AutoModelForCausalLM

            stock = AutoModelForCausalLM.from_pretrained(out / name, dtype=torch.float32).eval()
        manifest[name] = {"folder": name, "kind": fmt, "source": source, "reference": greedy(stock), "control": None,
                          "moe": False}
    if "G1-elementwise" in natives:
        save_tokenizer(out / "G1-elementwise")
    (out / "manifest.json").write_text(json.dumps({"prompts": PROMPTS, "new_tokens": NEW_TOKENS, "cases": manifest},
                                                  indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or [*NATIVE, *MOE, *EXPORTS, *REFUSED])
