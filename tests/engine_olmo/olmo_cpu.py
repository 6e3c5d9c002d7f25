"""OLMo-core 3.0.0's own model (`make test-olmo`, .venv-olmo): the fixtures of tests/conversion/olmo_core made and
saved by OLMo-core itself, and OLMo-core's logits of a checkpoint written by `gated-qwen convert --to olmo_core`.

    python olmo_cpu.py fixtures OUT          # OUT/{elementwise,headwise}/ as its trainer lays them out, and logits
    python olmo_cpu.py logits CKPT OUT.safetensors

OLMo-core runs on the CPU as it is (its default block, PyTorch attention); nothing is patched.
"""

import json
import sys
from pathlib import Path

import torch
from olmo_core.distributed.checkpoint import load_model_and_optim_state, save_model_and_optim_state
from olmo_core.nn.attention import GateConfig, GateGranularity
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.transformer import TransformerConfig
from safetensors.torch import save_file

INPUT_IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 3, 3, 101, 64, 12, 90], [100, 22, 8, 17, 54, 31, 77, 6, 9, 60, 3, 11]])


def config(granularity: str) -> TransformerConfig:
    """Hidden 64, 2 layers, 4 heads, 2 kv heads, the gate, per-head QK norm, SwiGLU, untied: the default block."""
    return TransformerConfig.llama_like(
        d_model=64, vocab_size=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, qk_norm=True,
        use_head_qk_norm=True, gate=GateConfig(granularity=GateGranularity(granularity)), layer_norm_eps=1e-6,
        rope_theta=10000, feed_forward=FeedForwardConfig(hidden_size=96, bias=False), init_std=0.1)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(INPUT_IDS).float()


def fixtures(out: Path) -> None:
    """OUT/{granularity}/: `model_and_optim/` saved by OLMo-core's `save_model_and_optim_state` (what its trainer
    calls) and `config.json` as its ConfigSaverCallback writes it (the model's config under `model`); its logits
    beside."""
    for seed, granularity in enumerate(("elementwise", "headwise")):
        cfg = config(granularity)
        torch.manual_seed(seed)
        model = cfg.build(init_device="cpu")
        model.init_weights(device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # norms drawn from [0.5, 1.5]: ones would hide a norm read wrong
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.copy_(torch.empty(parameter.shape).uniform_(0.5, 1.5, generator=generator))
        folder = out / granularity
        save_model_and_optim_state(folder / "model_and_optim", model)
        (folder / "config.json").write_text(json.dumps({"model": cfg.as_config_dict()}, indent=1) + "\n")
        save_file({"input_ids": INPUT_IDS, "logits": logits(model).contiguous()},
                  out / f"{granularity}.logits.safetensors")


def load_and_run(ckpt: Path, out: Path) -> None:
    """OLMo-core builds the model of CKPT's config.json, loads CKPT's model state into it (other weights before: the
    load must replace every one) and computes its logits."""
    cfg = TransformerConfig.from_dict(json.loads((ckpt / "config.json").read_text())["model"])
    torch.manual_seed(1234)
    model = cfg.build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    load_model_and_optim_state(ckpt / "model_and_optim", model)
    save_file({"input_ids": INPUT_IDS, "logits": logits(model).contiguous()}, out)


if __name__ == "__main__":
    if sys.argv[1] == "fixtures":
        fixtures(Path(sys.argv[2]))
    else:
        load_and_run(Path(sys.argv[2]), Path(sys.argv[3]))
