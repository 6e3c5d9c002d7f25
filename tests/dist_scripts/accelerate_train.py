"""A user's `train.py`: `Trainer` on saved GatedQwen folders, as tests/accelerate_runs.py launches it.

    accelerate launch --config_file examples/accelerate/<config>.yaml --num_processes 2 --mixed_precision no \\
        accelerate_train.py DATA OUT MODEL_DIR... [--steps N] [--batch B]
    python accelerate_train.py DATA OUT MODEL_DIR... --batch 2B      # the one-process reference: the same batches

DATA is a `torch.save`d `[N, S]` tensor of token ids (each row one example, its own labels). Each model in turn
(one launch for all: the processes start once) trains `--steps` AdamW steps of `--batch` rows per process, rows
taken in order (so 2 processes of B rows see what one process of 2B rows sees), in float32, with a checkpoint at the
last step. Rank 0 writes OUT/<model folder name>/run.json: the loss and gradient norm of every step (as `Trainer`
logs them: averaged over the processes), and what each rank's run was (Accelerate's distributed type, the wrapped
model's class, the ZeRO stage, the FSDP units and the gate's shards, whether the parameters were partitioned at
load), for the test to hold against what the config asks for. The model ends in OUT/<name>/final
(`Trainer.save_model`; with FSDP's sharded state dict that writes nothing: the test merges the checkpoint's).

On a machine without a GPU (docs/training.md): `ddp_backend="gloo"` when launched (without it DeepSpeed's batch-size
check fails, `2 != 2 * 1 * 2`), `ACCELERATE_USE_CPU=1` for DDP and FSDP (else Accelerate's type is `NO` and each
process trains alone), `DS_ACCELERATOR=cpu` for DeepSpeed, and for FSDP the lift of tests/dist_scripts/fsdp_on_cpu.py,
which this script applies unless `--no-fsdp-cpu-lift` is given (the test that the sharding check catches a skip).
"""

import argparse
import json
import os
from pathlib import Path

import torch
from accelerate import PartialState
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

import gated_qwen  # noqa: F401  (registers model_type "gated_qwen")


class Rows(Dataset):
    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def partitioned_at_load(model) -> bool | None:
    """Whether every parameter is a ZeRO-3 partition placeholder (None: not a ZeRO-3 run)."""
    params = list(model.parameters())
    if not any(hasattr(p, "ds_id") for p in params):
        return None
    return all(hasattr(p, "ds_id") and p.numel() == 0 and p.ds_tensor.numel() < p.ds_numel for p in params)


def fsdp_facts(model) -> dict:
    """The FSDP2 units and the first layer's gate parameters as this rank holds them."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    layers = model.model.layers
    gate = layers[0].self_attn.gate
    gate_params = {}
    for name, p in gate.named_parameters():
        gate_params[name] = {
            "dtensor": isinstance(p, DTensor),
            "shard0": isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),),
            "global_shape": list(p.shape),
            "local_shape": list((p.to_local() if isinstance(p, DTensor) else p).shape),
        }
    return {
        "root_wrapped": isinstance(model, FSDPModule),
        "layers_wrapped": [isinstance(layer, FSDPModule) for layer in layers],
        "all_parameters_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "gate": gate_params,
    }


class Record(TrainerCallback):
    """Takes the facts of the run once the model is wrapped (at the first step's start, on every rank)."""

    def __init__(self, trainer_ref: list):
        self.trainer_ref, self.facts = trainer_ref, {}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.facts:
            return
        trainer = self.trainer_ref[0]
        model, wrapped = trainer.model, trainer.model_wrapped
        facts = {"distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
                 "num_processes": trainer.accelerator.num_processes,
                 "wrapped_class": f"{type(wrapped).__module__}.{type(wrapped).__name__}"}
        if trainer.is_deepspeed_enabled:
            facts["zero_stage"] = trainer.deepspeed.zero_optimization_stage()
        if trainer.is_fsdp_enabled:
            facts["fsdp"] = fsdp_facts(model)
        gathered = [None] * trainer.accelerator.num_processes
        if trainer.accelerator.num_processes > 1:
            torch.distributed.all_gather_object(gathered, facts)
        else:
            gathered = [facts]
        self.facts = {"ranks": gathered}


def train(model_dir: Path, data: Path, out: Path, steps: int, batch: int, lr: float) -> None:
    # TrainingArguments first: it sets up the distributed state that from_pretrained reads (ZeRO-3's partitioned
    # loading).
    training = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=batch, learning_rate=lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, max_grad_norm=1.0,
        train_sampling_strategy="sequential", logging_steps=1, save_strategy="steps", save_steps=steps,
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        # gloo when launched; one process has no process group (Accelerate then refuses any backend)
        ddp_backend="gloo" if "LOCAL_RANK" in os.environ else None,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = {"partitioned_at_load": partitioned_at_load(model)}

    holder: list = []
    record = Record(holder)
    trainer = Trainer(model=model, args=training, train_dataset=Rows(torch.load(data)), callbacks=[record])
    holder.append(trainer)
    trainer.train()
    trainer.save_model(str(out / "final"))

    loaded_all = [None] * trainer.accelerator.num_processes
    if trainer.accelerator.num_processes > 1:
        torch.distributed.all_gather_object(loaded_all, loaded)
    else:
        loaded_all = [loaded]
    if trainer.accelerator.is_main_process:
        logs = [e for e in trainer.state.log_history if "loss" in e and "train_loss" not in e]
        run = {"loss": [e["loss"] for e in logs], "grad_norm": [e["grad_norm"] for e in logs],
               "steps": [e["step"] for e in logs], "loaded": loaded_all, **record.facts}
        (out / "run.json").write_text(json.dumps(run, indent=1))
    trainer.accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("data", type=Path)
    parser.add_argument("out", type=Path, help="one folder per model is made in it, named as the model's")
    parser.add_argument("model_dirs", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="rows per process and step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--no-fsdp-cpu-lift", action="store_true")
    args = parser.parse_args()
    if not args.no_fsdp_cpu_lift:
        import fsdp_on_cpu

        fsdp_on_cpu.lift()
    for model_dir in args.model_dirs:
        train(model_dir, args.data, args.out / model_dir.name, args.steps, args.batch, args.lr)
    # As a script should end (Accelerator.end_training does this): without it gloo's threads can outlive the
    # interpreter and a rank aborts at exit, "terminate called without an active exception" (pytorch#179291).
    PartialState().destroy_process_group()


if __name__ == "__main__":
    main()
