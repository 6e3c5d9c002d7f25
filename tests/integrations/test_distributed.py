"""Scaling out on Transformers' and PyTorch's own engines, checked with `torchrun --nproc_per_node 2` on CPU (gloo)
against one process with the same weights:

- tensor parallelism (`DistributedConfig(tp_plan="auto")`): the same logits, loss and gradients for every kind of
  gate (per-head gates sharded with their heads, head-shared and G5 gates whole on every rank);
- FSDP2 (`torch.distributed.fsdp.fully_shard` on every decoder layer and the root): one AdamW step, each rank on
  half of the batch, gives the weights of one step on the whole batch.

The ranks run tests/dist_scripts/tp_and_fsdp.py once (module fixture); the computations run in float64 so that
"the same" can be checked tightly.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import convert
from tests.helpers import SMALL, sizes

pytestmark = pytest.mark.slow  # every check here starts several processes

SCRIPT = Path(__file__).parents[1] / "dist_scripts" / "tp_and_fsdp.py"
TINY = sizes(SMALL, intermediate_size=128, tie_word_embeddings=True)
LR = 1e-2

# name -> (gate fields, whether the gate's weights are split across the 2 ranks)
VARIANTS = {
    "G1-elementwise": ({}, True),
    "G2-headwise": ({"gate_position": "value", "gate_granularity": "headwise"}, True),
    "G1-head-shared": ({"gate_shared_across_heads": True}, False),
    "G5-dense": ({"gate_position": "dense"}, False),
    "G1-input-independent": ({"gate_input_dependent": False}, True),
    "G1-input-independent-shared": ({"gate_input_dependent": False, "gate_shared_across_heads": True}, False),
    # the paper's release layout (gate rows packed in q_proj per kv group), read by from_pretrained directly
    "release-headwise": ({"gate_granularity": "headwise"}, True),
    # stock Qwen3 folders with a gate added at load time (function-preserving: zero g_proj, o_proj doubled)
    "qwen3-add-G1": ({"gate_position": "sdpa"}, True),
    "qwen3-add-head-shared-constant": ({"gate_input_dependent": False, "gate_shared_across_heads": True}, False),
}


def load_reference(folder: Path) -> GatedQwenForCausalLM:
    """The one-process model of a variant's folder, read as the 2-process script reads it."""
    gate_file = folder.parent / f"{folder.name}.gate.json"
    gate = json.loads(gate_file.read_text()) if gate_file.exists() else {}
    return GatedQwenForCausalLM.from_pretrained(folder, dtype=torch.float64, **gate)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Saves one tiny model per variant, runs the script on 2 ranks, returns (work_dir, input_ids)."""
    work = tmp_path_factory.mktemp("dist")
    for i, (name, (gate, _)) in enumerate(VARIANTS.items()):
        torch.manual_seed(i)
        model = GatedQwenForCausalLM(GatedQwenConfig(**TINY, **gate))
        for layer in model.model.layers:  # input-independent gates start at zero: make them differ per head
            if hasattr(layer.self_attn.gate, "logits"):
                torch.nn.init.normal_(layer.self_attn.gate.logits)
        if name.startswith("qwen3"):
            stock = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in TINY.items()}))
            stock.save_pretrained(work / name)
            (work / f"{name}.gate.json").write_text(json.dumps({"gate_position": "sdpa", **gate}))
            continue
        if name.startswith("release"):
            model.save_pretrained(work / "gated-for-release")
            convert(work / "gated-for-release", work / name, to_format="release", verify=False)
        else:
            model.save_pretrained(work / name)
    input_ids = torch.randint(0, TINY["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": input_ids, "lr": LR, "dtype": torch.float64}, work / "inputs.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(SCRIPT), str(work), *(str(work / n) for n in VARIANTS)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return work, input_ids


@pytest.mark.parametrize("name", VARIANTS)
def test_tensor_parallel_equals_one_process(run, name):
    work, input_ids = run
    tp = torch.load(work / f"tp-{name}.pt")
    model = load_reference(work / name)
    out = model(input_ids, labels=input_ids)
    out.loss.backward()

    torch.testing.assert_close(tp["logits"], out.logits.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(tp["loss"], out.loss.detach(), rtol=1e-12, atol=0)
    for param_name, param in model.named_parameters():
        torch.testing.assert_close(tp["grads"][param_name], param.grad, rtol=1e-10, atol=1e-14, msg=param_name)

    gate_shape, local_shape = tp["gate_shape"], tp["gate_local_shape"]
    gate = model.model.layers[0].self_attn.gate
    full = gate.g_proj.weight if hasattr(gate, "g_proj") else gate.logits
    assert gate_shape == tuple(full.shape)
    sharded = VARIANTS[name][1]
    expected_local = (gate_shape[0] // 2, *gate_shape[1:]) if sharded else gate_shape
    assert local_shape == expected_local, (name, local_shape)


def test_fsdp2_step_equals_one_process(run):
    work, input_ids = run
    fsdp = torch.load(work / "fsdp.pt")
    model = GatedQwenForCausalLM.from_pretrained(work / "G1-elementwise", dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model(input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    reference = model.state_dict()
    initial = GatedQwenForCausalLM.from_pretrained(work / "G1-elementwise", dtype=torch.float64).state_dict()

    assert fsdp.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(fsdp[key], value, rtol=1e-10, atol=1e-12, msg=key)
    gate = "model.layers.0.self_attn.gate.g_proj.weight"
    assert (fsdp[gate] - initial[gate]).abs().max() > LR / 2  # the step moved the gate (AdamW: about lr per weight)


def test_shipped_accelerate_configs_parse_and_name_our_decoder_layer():
    """examples/accelerate/*.yaml (docs/training.md; tests/integrations/test_accelerate.py and tests/distributed/ launch them) load
    with accelerate's own reader; the FSDP2 one wraps the decoder layer class the model has (a renamed class would
    silently stop the wrapping)."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    examples = Path(__file__).parents[2] / "examples" / "accelerate"
    fsdp = load_config_from_file(str(examples / "fsdp2.yaml"))
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.fsdp_config["fsdp_version"] == 2
    layer = fsdp.fsdp_config["fsdp_transformer_layer_cls_to_wrap"]
    assert layer in GatedQwenForCausalLM._no_split_modules
    assert type(GatedQwenForCausalLM(GatedQwenConfig(**TINY)).model.layers[0]).__name__ == layer
    for stage in (2, 3):
        zero = load_config_from_file(str(examples / f"deepspeed_zero{stage}.yaml"))
        assert zero.distributed_type == DistributedType.DEEPSPEED and zero.deepspeed_config["zero_stage"] == stage
    assert load_config_from_file(str(examples / "deepspeed_zero3.yaml")).deepspeed_config["zero3_init_flag"]
    assert load_config_from_file(str(examples / "ddp.yaml")).distributed_type == DistributedType.MULTI_GPU
