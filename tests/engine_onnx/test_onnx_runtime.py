"""GatedQwen models in ONNX Runtime 1.31.1, held against Transformers (docs/local.md).

- `gated-qwen convert --to onnx` of tiny models of every gate the model computes (the graph is traced from it:
  G1 to G5, elementwise and headwise, head-shared, additive, other activations, the non-gate control, no gate,
  Qwen3's attention biases, YaRN and linear RoPE scaling, mixtures of experts): every position's logits of three prompts within 1e-3 of
  Transformers' (float32, relative to max(1, max |logit|)), and greedy decoding with the graph's KV cache (each step
  one token, the `present.*` outputs fed back) gives Transformers' `generate` tokens, each step's logits within the
  same tolerance of Transformers' on the whole sequence; each gated model farther than that from the same weights
  without the gate.
- A batch with left padding, as Optimum and Transformers.js feed one.
- int8 dynamic quantization (`onnxruntime.quantization.quantize_dynamic`) of a briefly trained model: perplexity on
  held-out text beside the float32 graph's, which equals Transformers'.
- The weights beside the graph in one `model.onnx_data` file (what a model past ONNX's 2 GB gets), a tied embedding
  stored once, and a graph past 2 GiB (slow: 1 GiB of float32 weights) converted and run.
- Optimum's `ORTModelForCausalLM` (optimum-onnx 0.1.0, in .venv-optimum with the Transformers it requires) and
  Transformers.js 4.3.1 (in Node, and in headless Chromium on onnxruntime-web's WebAssembly backend: tests/engine_onnx/js)
  run the folders: their logits and their `generate`, through the graph's KV cache, are Transformers'.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="needs onnx and onnxruntime: make test-onnx (.venv-onnx)")

from transformers import AutoModelForCausalLM  # noqa: E402

from gated_qwen.conversion import convert  # noqa: E402
from gated_qwen.conversion.formats import onnx as onnx_format  # noqa: E402
from tests.engine_onnx.conftest import ort_greedy  # noqa: E402
from tests.helpers import assert_refused, gate_variants, text_file, tiny_tokenizer  # noqa: E402
from tests.local_models import (  # noqa: E402
    MOE,
    NEW_TOKENS,
    PROMPTS,
    RTOL,
    build,
    distance,
    parity_test,
    train,
    transformers_answer,
    transformers_perplexity,
    windows,
)


def seen(fields: dict) -> dict:
    """`fields`, without the q/k norm where the gate is one score per head on the queries or the keys: the per-head
    RMSNorm after it divides that score out (up to its eps), so the logits would not show the gate."""
    divided_out = fields.get("gate_granularity") == "headwise" and fields.get("gate_position") in ("query", "key")
    return dict(fields, use_qk_norm=False) if divided_out else fields


# name -> config fields besides local_models.SIZES: every gate (`--to onnx` traces the model, and refuses none), then
# what else the graph holds
CASES = {name: seen(fields) for name, fields in gate_variants().items()} | {
    "g1_gate_layers": dict(gate_layers=[1]),
    "attention_bias_yarn": dict(attention_bias=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
    "linear_rope": dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "moe_g1": dict(MOE),
    "moe_g1_headwise_no_shared_expert": dict(MOE, gate_granularity="headwise", shared_expert_intermediate_size=0),
}


def whole_sequence_logits(folder, tokens: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def ort_answer(folder) -> dict:
    """`ort_greedy` of each prompt: its logits, greedy tokens and each cached step's logits."""
    runs = [ort_greedy(folder, prompt, NEW_TOKENS) for prompt in PROMPTS]
    return {key: [run[key] for run in runs] for key in ("logits", "greedy", "steps")}


def each_cached_step_is_transformers_on_the_whole_sequence(case, ran):
    for prompt, greedy, steps in zip(PROMPTS, ran["greedy"], ran["steps"]):
        whole = whole_sequence_logits(case["folder"], prompt + greedy)
        positions = range(len(prompt) - 1, len(prompt) - 1 + NEW_TOKENS)
        assert distance(steps, [whole[p] for p in positions]) <= RTOL


cases, test_onnx_runtime_computes_transformers_logits_and_greedy_tokens = parity_test(
    "ONNX Runtime", "onnx", CASES, ort_answer, also=each_cached_step_is_transformers_on_the_whole_sequence)


def test_a_left_padded_batch(cases):
    """Two prompts of different lengths in one call, the shorter padded on the left (attention mask 0, positions
    counted from its first real token): each real position's logits are Transformers' for that prompt alone."""
    case = cases["G1-elementwise"]
    short, long = PROMPTS[0], PROMPTS[2]
    pad = len(long) - len(short)
    mask = np.array([[0] * pad + [1] * len(short), [1] * len(long)])
    feed = {"input_ids": np.array([[0] * pad + short, long]), "attention_mask": mask,
            "position_ids": np.clip(mask.cumsum(-1) - 1, 0, None),
            **onnx_format.empty_past(json.loads((case["converted"] / "config.json").read_text()), 2)}
    logits = onnx_format.session(case["converted"]).run(["logits"], feed)[0]
    reference = case["transformers"]["logits"]
    assert distance([logits[0, pad:], logits[1]], [reference[0], reference[2]]) <= RTOL


def test_weights_beside_the_graph_in_one_file_and_a_tied_embedding_once(tmp_path, monkeypatch):
    """A graph whose weights pass the limit (ONNX's 2 GB; lowered here) keeps them in one `model.onnx_data` file
    beside `model.onnx`, which ONNX Runtime reads with it; a tied embedding is stored once (the lm_head reads it
    through a Transpose), and the logits are Transformers'."""
    import onnx

    folder = build(tmp_path / "gated", dict(tie_word_embeddings=True))
    monkeypatch.setattr(onnx_format, "EXTERNAL_DATA_BYTES", 1)
    convert(folder, tmp_path / "onnx", to_format="onnx")  # --verify runs it in ONNX Runtime
    assert sorted(p.name for p in (tmp_path / "onnx").iterdir()) == [
        "config.json", "generation_config.json", "model.onnx", "model.onnx_data"]
    graph, data = ((tmp_path / "onnx" / name).stat().st_size for name in ("model.onnx", "model.onnx_data"))
    assert graph < data  # tensors under 1 KB stay inside the graph, as in Optimum's exports
    config = json.loads((folder / "config.json").read_text())
    embedding = config["vocab_size"] * config["hidden_size"]
    initializers = onnx.load(str(tmp_path / "onnx" / "model.onnx"), load_external_data=False).graph.initializer
    assert [list(i.dims) for i in initializers if np.prod(i.dims) == embedding] == [
        [config["vocab_size"], config["hidden_size"]]]
    run = ort_greedy(tmp_path / "onnx", PROMPTS[1], NEW_TOKENS)
    reference = transformers_answer(folder)
    assert run["greedy"] == reference["greedy"][1]
    assert distance([run["logits"]], [reference["logits"][1]]) <= RTOL


@pytest.mark.slow
def test_a_graph_past_2_gib_converts_and_runs(tmp_path):
    """1 GiB of float32 weights, most of it a tied embedding [262144, 1024] that the exporter's own graph holds twice
    (past protobuf's 2 GiB): `convert --to onnx --verify` writes it and ONNX Runtime's logits are Transformers'."""
    from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM

    config = GatedQwenConfig(vocab_size=262144, hidden_size=1024, intermediate_size=1024, num_hidden_layers=1,
                             num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True)
    GatedQwenForCausalLM(config).save_pretrained(tmp_path / "gated")
    assert (tmp_path / "gated" / "model.safetensors").stat().st_size > 2**30
    convert(tmp_path / "gated", tmp_path / "onnx", to_format="onnx", verify=True)
    ids = torch.tensor([PROMPTS[2]])
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gated", dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(ids).logits[0].numpy()
    del model
    assert distance([onnx_format.onnx_logits(tmp_path / "onnx", ids)[0].numpy()], [reference]) <= RTOL


def test_int8_dynamic_quantization_and_its_perplexity(tmp_path):
    """ONNX Runtime's dynamic int8 quantization (weights int8 per tensor, activations quantized at run time) of a
    tiny GatedQwen trained 150 steps on text; perplexity on held-out text of the same kind: float32 in ONNX Runtime
    equals Transformers', the int8 graph's is reported beside it (docs/local.md)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    folder = tmp_path / "trained"
    tiny_tokenizer(folder, vocab_size=320)
    train(folder, text_file(tmp_path / "train.txt", words=6000).read_text(), dict(intermediate_size=128))
    data = windows(folder, text_file(tmp_path / "heldout.txt", words=3000, seed=1).read_text())
    convert(folder, tmp_path / "onnx", to_format="onnx")
    quantize_dynamic(tmp_path / "onnx" / "model.onnx", tmp_path / "onnx" / "model_int8.onnx",
                     weight_type=QuantType.QInt8)
    result = {"transformers": transformers_perplexity(folder, data),
              "onnx": ort_perplexity(tmp_path / "onnx", data),
              "int8": ort_perplexity(tmp_path / "onnx", data, "model_int8.onnx")}
    print("perplexity on held-out text:", json.dumps(result))
    assert abs(result["onnx"] - result["transformers"]) <= 1e-4 * result["transformers"]
    assert result["transformers"] < 320 / 4  # trained: far below the uniform guess (the vocabulary, 320)
    assert result["int8"] != result["onnx"] and result["int8"] < 1.25 * result["onnx"]
    sizes = {file: (tmp_path / "onnx" / file).stat().st_size for file in ("model.onnx", "model_int8.onnx")}
    assert sizes["model_int8.onnx"] < 0.5 * sizes["model.onnx"]


def ort_perplexity(folder, data: np.ndarray, file: str = "model.onnx") -> float:
    """exp(mean next-token cross-entropy) of the graph `file` over the windows `data`, each window one call."""
    config = json.loads((folder / "config.json").read_text())
    graph = onnx_format.session(folder, file)
    inputs, targets = data[:, :-1], data[:, 1:]
    feed = {"input_ids": inputs, "attention_mask": np.ones_like(inputs), "position_ids":
            np.tile(np.arange(inputs.shape[1]), (len(inputs), 1)), **onnx_format.empty_past(config, len(inputs))}
    logits = torch.from_numpy(graph.run(["logits"], feed)[0])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(targets).reshape(-1))
    return float(loss.exp())


REFUSED = {  # name: (config fields, the message)
    "sliding window": (dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), "'sliding_attention'"),
    "dynamic RoPE": (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
                     "rope_type='dynamic'"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_trace_cannot_keep_is_refused(tmp_path, capsys, case):
    """A traced sliding-window mask, or RoPE frequencies that change with the length, keep the lengths they were
    traced with (ONNX Runtime fails, or computes another model, on others): refused in one line, nothing written."""
    fields, message = REFUSED[case]
    folder = build(tmp_path / "gated", fields)
    assert_refused(capsys, ["convert", str(folder), str(tmp_path / "onnx"), "--to", "onnx"], message, tmp_path / "onnx",
                   bars=True)


# ORTModelForCausalLM takes the head size as hidden_size / num_attention_heads (run_optimum.py): models where it is.
OPTIMUM_CASES = {name: CASES[name] for name in ("G1-elementwise", "G1-headwise", "baseline", "moe_g1")}
OPTIMUM_PYTHON = Path(os.environ.get("GATED_QWEN_OPTIMUM_PYTHON",
                                     Path(__file__).resolve().parents[2] / ".venv-optimum" / "bin" / "python"))


@pytest.mark.parametrize("name", OPTIMUM_CASES)
def test_optimums_ort_model_for_causal_lm_runs_the_folder(tmp_path, name):
    assert OPTIMUM_PYTHON.exists(), f"{OPTIMUM_PYTHON} is missing: `make test-onnx` builds .venv-optimum"
    folder = build(tmp_path / "gated", dict(OPTIMUM_CASES[name], hidden_size=128, intermediate_size=128))
    convert(folder, tmp_path / "onnx", to_format="onnx")
    run = subprocess.run([str(OPTIMUM_PYTHON), str(Path(__file__).with_name("run_optimum.py")), str(tmp_path / "onnx"),
                          json.dumps(PROMPTS), str(NEW_TOKENS)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = json.loads(run.stdout)
    reference = transformers_answer(folder)
    error = distance([np.array(logits) for logits in ran["logits"]], reference["logits"])
    print(f"{name}: ORTModelForCausalLM's logits {error:.3g} from Transformers' (relative), greedy {ran['greedy'][0]}")
    assert error <= RTOL
    assert ran["greedy"] == reference["greedy"]
    assert ran["cached_steps"] == [NEW_TOKENS - 1] * len(PROMPTS)  # every step after the prompt: one token + its past


JS = Path(__file__).resolve().parent / "js"


def check_javascript_run(case: dict, command: list[str], engine: str) -> None:
    """`command` printed Transformers.js's logits (flat) and greedy tokens for PROMPTS as its last line: within
    RTOL of Transformers' logits, and Transformers' tokens."""
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ran = json.loads(run.stdout.strip().splitlines()[-1])
    assert "error" not in ran, ran.get("error")
    reference = case["transformers"]
    logits = [np.array(flat, np.float32).reshape(r.shape) for flat, r in zip(ran["logits"], reference["logits"])]
    error = distance(logits, reference["logits"])
    print(f"{engine}: logits {error:.3g} from Transformers' (relative), greedy {ran['greedy'][0]}")
    assert error <= RTOL
    assert ran["greedy"] == reference["greedy"]


@pytest.mark.parametrize("name", ["G1-elementwise", "G1-headwise", "G2-headwise", "moe_g1"])
def test_transformers_js_runs_the_folder(cases, name):
    """Transformers.js in Node (onnxruntime-node, CPU), given the folder's config as a Qwen3's
    (js/run_transformers_js.mjs says why)."""
    assert (JS / "node_modules" / ".installed").exists(), "`make test-onnx` installs tests/engine_onnx/js/node_modules"
    check_javascript_run(cases[name], ["node", str(JS / "run_transformers_js.mjs"), str(cases[name]["converted"]),
                                       json.dumps(PROMPTS), str(NEW_TOKENS)], f"Transformers.js in Node, {name}")


@pytest.mark.skipif(shutil.which("chromium") is None, reason=(
    "no chromium on PATH: Transformers.js in a browser runs where Debian's chromium is installed (apt-get install "
    "chromium); make test-onnx does not install it"))
@pytest.mark.parametrize("name", ["G1-elementwise", "moe_g1"])
def test_transformers_js_runs_the_folder_in_a_browser(cases, name):
    """Transformers.js's web build in headless Chromium, on onnxruntime-web's WebAssembly backend, served on loopback
    (js/run_in_browser.py, js/page.html)."""
    assert (JS / "node_modules" / ".installed").exists(), "`make test-onnx` installs tests/engine_onnx/js/node_modules"
    check_javascript_run(cases[name], [sys.executable, str(JS / "run_in_browser.py"), str(cases[name]["converted"]),
                                       json.dumps(PROMPTS), str(NEW_TOKENS)], f"Transformers.js in Chromium, {name}")
