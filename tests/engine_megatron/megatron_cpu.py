"""Megatron-core 0.16.1's own GPT model on the CPU, in processes of their own (`make test-megatron`, .venv-megatron):
the fixtures of tests/conversion/megatron made by Megatron-core itself, and Megatron-core's logits of a checkpoint.

    python megatron_cpu.py fixtures OUT            # OUT/{tp1,tp2,legacy_tp2}/, logits (Megatron's forward)
    python megatron_cpu.py logits CKPT OUT.safetensors --tp N   # Megatron-core loads CKPT (tensor parallel N)

Megatron-core is written for CUDA; what it needs to run on the CPU is patched here, and only here (`cpu_patches`),
each with its reason. Tensor parallelism runs as N gloo processes on this machine.
"""

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

# The fixtures' model: hidden 64, 2 layers, 4 heads in 2 query groups, the output gate (G1 elementwise), QK-norm,
# SwiGLU, untied output layer, Megatron-LM's default norm epsilon (1e-5), as Megatron-LM's arguments.
ARGS = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
            num_query_groups=2, kv_channels=16, padded_vocab_size=128, max_position_embeddings=64,
            position_embedding_type="rope", rotary_base=10000, normalization="RMSNorm", norm_epsilon=1e-5,
            qk_layernorm=True, swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
            attention_output_gate=True)
INPUT_IDS = torch.tensor([[1, 5, 9, 20, 33, 7, 3, 3, 101, 64, 12, 90], [100, 22, 8, 17, 54, 31, 77, 6, 9, 60, 3, 11]])


def cpu_patches() -> None:
    """What Megatron-core needs to run on the CPU."""
    from megatron.core.tensor_parallel import random as mrandom

    # Megatron places parameters and buffers on `torch.cuda.current_device()`: "cpu" keeps them here.
    torch.cuda.current_device = lambda: "cpu"
    # Its checkpoint writer calls `torch.cuda.synchronize()` unconditionally (filesystem_async.py): nothing to wait for.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # The model-parallel RNG tracker forks CUDA generator states around dropout and initialisation: the CPU's serves.
    mrandom.CudaRNGStatesTracker.fork = lambda self, *args, **kwargs: contextlib.nullcontext()


def start(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu_patches()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)


def build(args: dict, seed: int = 0):
    """Megatron-core's GPTModel (local layer spec: no Transformer Engine) for Megatron-LM's arguments `args`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=args["num_attention_heads"], num_query_groups=args["num_query_groups"],
        kv_channels=args["kv_channels"], normalization="RMSNorm", layernorm_epsilon=args["norm_epsilon"],
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        qk_layernorm=args["qk_layernorm"], attention_output_gate=args["attention_output_gate"],
        tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True, params_dtype=torch.float32,
        init_method_std=0.1, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(qk_layernorm=args["qk_layernorm"], normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=args["padded_vocab_size"],
                     max_sequence_length=args["max_position_embeddings"], position_embedding_type="rope",
                     rotary_base=args["rotary_base"], parallel_output=False,
                     share_embeddings_and_output_weights=not args["untie_embeddings_and_output_weights"])
    return model.eval()


def randomize_norms(model, seed: int) -> None:
    """Norm weights drawn from [0.5, 1.5] (ones would hide a norm read wrong), the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            values = torch.empty(parameter.shape).uniform_(0.5, 1.5, generator=generator)
            if "layernorm" in name:
                parameter.copy_(values)


def logits(model) -> torch.Tensor:
    """Megatron's forward of INPUT_IDS `[B, S]` -> `[B, S, vocab]`. Its `attention_mask=None` builds the causal
    mask on "cuda": the mask is given (True: masked)."""
    seq = INPUT_IDS.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model(INPUT_IDS, torch.arange(seq).expand_as(INPUT_IDS), mask).float()


def make_fixture(rank: int, world: int, port: int, out: str) -> None:
    """tp{world}/ under `out`: the model saved by `dist_checkpointing.save` with `world` tensor-parallel ranks, its
    logits beside it. TP 1 saves as Megatron-LM does (its arguments in common.pt); TP 2 as megatron-core alone does
    (nothing in common.pt: the arguments in a config.json beside the files), and also as Megatron-LM's legacy `torch`
    format saves it (legacy_tp2/mp_rank_0N/model_optim_rng.pt: its arguments and each rank's state dict)."""
    start(rank, world, port)
    from megatron.core import dist_checkpointing

    model = build(ARGS, seed=world)
    randomize_norms(model, seed=world)
    folder = Path(out) / f"tp{world}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"model": model.sharded_state_dict()}
    if world == 1:
        state.update(args=argparse.Namespace(**ARGS, tensor_model_parallel_size=1), checkpoint_version=3.0,
                     iteration=0)
    dist_checkpointing.save(state if world == 1 else state["model"], str(folder))
    if world > 1:  # Megatron-LM's legacy `torch` format of the same model: one file per tensor-parallel rank
        legacy = Path(out) / f"legacy_tp{world}" / f"mp_rank_{rank:02d}"
        legacy.mkdir(parents=True, exist_ok=True)
        torch.save({"args": argparse.Namespace(**ARGS, tensor_model_parallel_size=world), "checkpoint_version": 3.0,
                    "iteration": 0, "model": model.state_dict_for_save_checkpoint()}, legacy / "model_optim_rng.pt")
    result = logits(model)
    if rank == 0:
        if world > 1:
            (folder / "config.json").write_text(json.dumps(ARGS, indent=1) + "\n")
        save_file({"input_ids": INPUT_IDS, "logits": result.contiguous()}, Path(out) / f"tp{world}.logits.safetensors")
    dist.barrier()
    dist.destroy_process_group()


def load_and_run(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    """Megatron-core builds the model its checkpoint's common.pt describes, loads the checkpoint with
    `dist_checkpointing.load` (`world` tensor-parallel ranks) and computes its logits into `out`."""
    start(rank, world, port)
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(ckpt)
    args = vars(common["args"])
    model = build(args, seed=1234)  # other weights than the checkpoint's: loading must replace every one
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt)  # as Megatron-LM loads
    model.load_state_dict(state["model"])
    result = logits(model)
    if rank == 0:
        save_file({"input_ids": INPUT_IDS, "logits": result.contiguous()}, out)
    dist.barrier()
    dist.destroy_process_group()


def spawn(function, world: int, *args) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(function, args=(world, port, *args), nprocs=world, join=True)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["fixtures", "logits"])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "fixtures":
        for world in (1, 2):
            spawn(make_fixture, world, args.paths[0])
    else:
        spawn(load_and_run, args.tp, *args.paths)


if __name__ == "__main__":  # Megatron's checkpoint writers run in worker processes that import this module
    main(sys.argv[1:])
