"""The loading promises of docs/loading.md, kept by a saved folder's own code where the gated_qwen package is not
installed (`trust_remote_code=True`, the package made unimportable in a fresh interpreter, as a user who loads from
the Hub meets it), dense and mixture of experts: a checkpoint without one of its gate tensors, or with one of another
shape, is refused in one line naming the layer and the tensor, rather than starting that gate at random; any other
tensor of another shape is refused unless `ignore_mismatched_sizes=True`; a bad config value is refused, naming the
field; a folder of another format (the paper's release) is refused, naming the package that reads it. Each refusal is
the package's own message for the same folder. `make test-slow` runs this under Transformers 5.24, `make test-compat`
under 5.17 and `make test-serving` under 5.19."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from tests.helpers import SMALL, TINY, TINY_MOE, bare_environment, randomize_, sizes

pytestmark = pytest.mark.slow  # a fresh interpreter

# What the folder's own code answers to each case, run with the package unimportable; printed as JSON.
WITHOUT_THE_PACKAGE = r"""
import json, sys
sys.modules["gated_qwen"] = None  # the package is not installed on this machine
import torch
from transformers import AutoConfig, AutoModelForCausalLM

folders, prompt = json.loads(sys.argv[1]), torch.tensor([[3, 14, 15, 9, 2, 6]])
answers = {}
model = AutoModelForCausalLM.from_pretrained(folders.pop("saved"), trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
answers["saved"] = model(prompt).logits.tolist()
remote = type(model)  # the folder's own class, as `from_pretrained` of a class a user holds
for case, (folder, kwargs) in folders.items():
    try:
        loader = remote.from_pretrained if case == "release" else AutoModelForCausalLM.from_pretrained
        loaded = loader(folder, trust_remote_code=True, **kwargs)
        answers[case] = {"loaded": type(loaded).__module__}
    except Exception as error:
        answers[case] = {"refused": f"{type(error).__name__}: {error}"}
print(json.dumps(answers))
"""


def edited(saved: Path, folder: Path, tensors=None, config=None) -> Path:
    """A copy of the saved folder `saved` with its tensors or config.json edited by the given functions."""
    shutil.copytree(saved, folder)
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        values = json.loads((folder / "config.json").read_text())
        config(values)
        (folder / "config.json").write_text(json.dumps(values))
    return folder


def answer_with_the_package(model_class, case: str, folder: Path, kwargs: dict) -> dict:
    """What the package's classes answer to the same case."""
    try:
        loaded = model_class.from_pretrained(folder, **kwargs)
        return {"loaded": type(loaded).__module__}
    except Exception as error:
        return {"refused": f"{type(error).__name__}: {error}"}


MODELS = {
    "dense": (GatedQwenForCausalLM, GatedQwenConfig(**SMALL)),
    "mixture of experts": (GatedQwenMoeForCausalLM, GatedQwenMoeConfig(**sizes(SMALL, **TINY_MOE))),
}
GATE = "model.layers.1.self_attn.gate.g_proj.weight"
OTHER = "model.layers.0.self_attn.o_proj.weight"


@pytest.mark.parametrize("kind", MODELS)
def test_the_shipped_code_keeps_the_loading_promises_without_the_package(tmp_path, kind):
    from gated_qwen.conversion import convert

    model_class, config = MODELS[kind]
    model = randomize_(model_class(config), seed=5, scale=0.3).eval()
    saved = tmp_path / "saved"
    model.save_pretrained(saved)
    cases = {
        "missing gate": (edited(saved, tmp_path / "missing", tensors=lambda s: s.pop(GATE)), {}),
        "gate of another shape": (edited(saved, tmp_path / "gate-shape", tensors=lambda s: s.update(
            {GATE: s[GATE][:-1]})), {"ignore_mismatched_sizes": True}),
        "tensor of another shape": (edited(saved, tmp_path / "shape", tensors=lambda s: s.update(
            {OTHER: s[OTHER][:, :-1].contiguous()})), {}),
        "tensor of another shape, allowed": (tmp_path / "shape", {"ignore_mismatched_sizes": True}),
        "bad config value": (edited(saved, tmp_path / "config", config=lambda c: c.update(gate_position="g9")), {}),
        "gate the config does not have": (edited(saved, tmp_path / "extra-gate", config=lambda c: c.update(
            gate_layers=[0])), {}),
    }
    if kind == "dense":
        dense = GatedQwenForCausalLM(GatedQwenConfig(**TINY))
        dense.save_pretrained(tmp_path / "gated")
        cases["release"] = (convert(tmp_path / "gated", tmp_path / "release", to_format="release", verify=False), {})
    folders = {"saved": str(saved), **{case: (str(folder), kwargs) for case, (folder, kwargs) in cases.items()}}
    env = bare_environment(tmp_path / "hf_home")
    result = subprocess.run([sys.executable, "-c", WITHOUT_THE_PACKAGE, json.dumps(folders)],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout.splitlines()[-1])

    with torch.no_grad():  # the folder as saved loads and computes what the model did
        expected = model(torch.tensor([[3, 14, 15, 9, 2, 6]])).logits
    assert torch.equal(torch.tensor(answers.pop("saved")), expected)
    with_the_package = {case: answer_with_the_package(model_class, case, folder, kwargs)
                        for case, (folder, kwargs) in cases.items()}
    for case in set(cases) - {"release", "tensor of another shape, allowed"}:  # each refusal is the package's own
        assert answers[case] == with_the_package[case], case
    refusals = {case: answer["refused"] for case, answer in answers.items() if "refused" in answer}
    assert set(refusals) == set(cases) - {"tensor of another shape, allowed"}, answers
    tensors = ("missing gate", "gate of another shape", "tensor of another shape", "gate the config does not have")
    assert all("\n" not in refusals[case] for case in tensors), refusals  # one line each
    assert refusals["missing gate"] == (
        f"ValueError: the checkpoint has no tensor for {GATE}, yet its config has a gate (gate_position='sdpa'); "
        "refusing to start that gate at random. Load the folder with the config it was saved with, or pass gate "
        "fields only to add a gate to a stock Qwen3 folder.")
    assert refusals["gate the config does not have"] == (
        f"ValueError: the checkpoint holds {GATE}, a gate its config does not have (gate_layers=[0]); refusing to drop "
        "it. Load the folder with the config it was saved with.")
    assert f"a tensor of another shape for {GATE}" in refusals["gate of another shape"]
    assert f"the checkpoint's {OTHER} has shape" in refusals["tensor of another shape"]
    assert "gate_position" in refusals["bad config value"] and "'g9'" in refusals["bad config value"]
    if kind == "dense":  # the package reads the paper's release; a folder's own code names it
        assert "model_type 'qwen3'" in refusals["release"] and "the gated_qwen package" in refusals["release"]
        assert with_the_package["release"] == {"loaded": "gated_qwen.model.modeling_gated"}
    assert answers["tensor of another shape, allowed"]["loaded"].startswith("transformers_modules")
    assert "loaded" in with_the_package["tensor of another shape, allowed"]
