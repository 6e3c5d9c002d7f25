"""Run by tests/integrations/test_distributed.py as `torchrun --nproc_per_node 2 tp_and_fsdp.py WORK_DIR MODEL_DIR...` (CPU, gloo).

WORK_DIR/inputs.pt holds `{"input_ids": [B, S] (B even), "lr": float, "dtype": torch.dtype}` (the models are
loaded in that dtype). Rank 0 writes, for the test to hold against one process:
- WORK_DIR/tp-<name>.pt for each MODEL_DIR, loaded with `DistributedConfig(tp_plan="auto")`: the logits and loss of
  one forward on the batch, every parameter's gradient gathered whole, and the local/global shapes of the gate's
  weights (to show it was sharded);
- WORK_DIR/fsdp.pt: the first MODEL_DIR's full state dict after one AdamW step under FSDP2 (`fully_shard` on every
  decoder layer and the root), each rank training on its half of the batch.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import gated_qwen  # registers model_type "gated_qwen")


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tensor_parallel(model_dir: Path, input_ids: torch.Tensor, dtype: torch.dtype) -> dict:
    # A gated_qwen folder through the Auto class; a folder of another format (the paper's release) the way its
    # README says: through GatedQwenForCausalLM.
    # (a stock Qwen3 folder gets the gate fields in MODEL_DIR/../<name>.gate.json)
    native = json.loads((model_dir / "config.json").read_text())["model_type"] == "gated_qwen"
    gate_file = model_dir.parent / f"{model_dir.name}.gate.json"
    gate = json.loads(gate_file.read_text()) if gate_file.exists() else {}
    model = (AutoModelForCausalLM if native else gated_qwen.GatedQwenForCausalLM).from_pretrained(
        model_dir, dtype=dtype, distributed_config=DistributedConfig(tp_plan="auto"), **gate
    )
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    gate = model.model.layers[0].self_attn.gate
    gate = gate.g_proj.weight if hasattr(gate, "g_proj") else gate.logits
    return {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "grads": {name: full(p.grad) for name, p in model.named_parameters()},
        "gate_shape": tuple(gate.shape),
        "gate_local_shape": tuple((gate.to_local() if isinstance(gate, DTensor) else gate).shape),
    }


def fsdp_step(model_dir: Path, input_ids: torch.Tensor, lr: float, dtype: torch.dtype) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    half = input_ids.chunk(dist.get_world_size())[dist.get_rank()]
    model(half, labels=half).loss.backward()  # FSDP2 averages the gradients over ranks
    optimizer.step()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def main() -> None:
    work_dir, model_dirs = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    inputs = torch.load(work_dir / "inputs.pt")
    input_ids = inputs["input_ids"]
    for model_dir in model_dirs:
        result = tensor_parallel(model_dir, input_ids, inputs["dtype"])
        if dist.get_rank() == 0:
            torch.save(result, work_dir / f"tp-{model_dir.name}.pt")
    state = fsdp_step(model_dirs[0], input_ids, inputs["lr"], inputs["dtype"])
    if dist.get_rank() == 0:
        torch.save(state, work_dir / "fsdp.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
