"""Megatron-core's distributed checkpoint (`torch_dist`: `.metadata`, `__*_*.distcp`, `common.pt`, `metadata.json`),
as `dist_checkpointing.save` of a GPT model writes it, Megatron-LM's `iter_NNNNNNN/` included; read and written with
`torch.distributed.checkpoint` alone (`dcp.py`), no Megatron installed. Megatron-LM's legacy `torch` format
(`mp_rank_0N/model_optim_rng.pt`, per-layer names) is read too, its tensor-parallel shards merged (`LegacyCheckpoint`,
with `--allow-pickle`).

Layout. The layers are stacked on a leading dimension `L`: `decoder.layers.self_attention.linear_qkv.weight` is
`[L, G·(2·H/G + 2)·D, hidden]` with an output gate (`attention_output_gate`, G1 elementwise), its rows per query
group `[queries of the group's H/G heads | their gate rows | k | v]` (without a gate `[queries | k | v]`); norms
carry fused names (`linear_qkv.layer_norm_weight`: the input norm, `linear_fc1.layer_norm_weight`: the pre-MLP
norm), `linear_fc1` is `[gate; up]` of SwiGLU, `_extra_state` entries are bytes. The global tensors do not depend
on the tensor-parallel size they were saved with. The shape of the model comes from `common.pt`'s `args`
(Megatron-LM's arguments) or, where it has none (a megatron-core save), a `config.json` in SRC with the same names
(`ARGS`: Megatron-LM's defaults for the absent ones; `padded_vocab_size` from the embedding).

GatedQwen keeps the same weights: the import is a permutation of rows (`split_qkv`), the export its inverse. Megatron
computes the gate as an elementwise sigmoid of a linear map: every G1 sigmoid gate is written exactly (a headwise
gate as each head's row repeated `head_dim` times, which training in Megatron then unties; an input-independent
gate or an ungated layer as zero rows with `linear_proj` scaled). Import gives G1 elementwise (no gate without
`attention_output_gate`). `apply_layernorm_1p` (norms stored as w - 1) is read and written as such.

Refused, naming the field: multi-latent attention, linear-attention (Gated DeltaNet) layers, mixtures of experts (not
mapped), biases, LayerNorm, an MLP other than SwiGLU, RoPE other than Megatron's default (interleaved, partial,
scaled) or learned positions, `apply_residual_connection_post_layernorm`, and an untied model without its output
layer. `--to megatron` writes DST as the checkpoint folder that `dist_checkpointing.load` reads (the `iter_0000000`
of a Megatron-LM save, `common.pt` with the arguments it needs).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import signal
import types
from contextlib import closing
from pathlib import Path, PosixPath

import torch

from ...files import read_json_object, say
from ..dcp import METADATA, DcpCheckpoint, dcp_files, write_dcp
from ..errors import CheckpointFormatError, ConversionError
from ..export_steps import check_g1_sigmoid, g1_gate_rows, load_gated_config
from ..format_types import FileWriting, Format, OwnModel, Reading
from ..io import Checkpoint, TensorInfo, TensorPlan, source_file, unpickling_reason
from ..plans import TensorMap

NAME = "megatron"
LAYERS = "decoder.layers."
# Megatron-LM's arguments this format reads, with Megatron-LM's defaults (absent from config.json: these).
ARGS = dict(
    num_layers=None, hidden_size=None, ffn_hidden_size=None, num_attention_heads=None, group_query_attention=False,
    num_query_groups=1, kv_channels=None, padded_vocab_size=None, max_position_embeddings=None,
    position_embedding_type="learned_absolute", rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
    use_rope_scaling=False, normalization="LayerNorm", norm_epsilon=1e-5, apply_layernorm_1p=False,
    qk_layernorm=False, swiglu=False, add_bias_linear=True, add_qkv_bias=False,
    untie_embeddings_and_output_weights=False, attention_output_gate=False, multi_latent_attention=False,
    num_experts=None, experimental_attention_variant=None, apply_residual_connection_post_layernorm=False,
    bf16=False, fp16=False)
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads")
# name in the checkpoint (after `decoder.layers.`) -> what it is, for the per-layer tensors
QKV, PROJ, QNORM, KNORM = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                           "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")
INPUT_NORM, MLP_NORM = "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
FC1, FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
EXTRA_STATES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
EMBEDDING, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", \
    "output_layer.weight"
# Tensor names of what GatedQwen has no equivalent of, with what they are.
FOREIGN = {"linear_q_down_proj": "multi-latent attention (MLA)", "linear_kv_down_proj": "multi-latent attention (MLA)",
           "in_proj": "linear-attention (Gated DeltaNet) layers", "A_log": "linear-attention (Gated DeltaNet) layers",
           "mlp.router": "a mixture of experts", "mlp.experts": "a mixture of experts"}
IGNORED = ("optimizer.", "rng_state", "rerun_state_machine_state")  # training state beside the model


# ------------------------------------------------------------------------------------------------------ reading
class _Foreign:
    """Stands in for a class of Megatron's (an enum, a config) met in `common.pt`: nothing of it is run."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


# The non-torch classes Megatron's `common.pt` holds (megatron/core/safe_globals.py), read as `_Foreign`.
MEGATRON_CLASSES = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                    "megatron.core.enums.ModelType", "megatron.core.optimizer.OptimizerConfig",
                    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
                    "megatron.core.rerun_state_machine.RerunState")


def read_common(folder: Path) -> dict:
    """`common.pt` of a torch_dist checkpoint (`_load`: `argparse.Namespace` and the like allowed, Megatron's own
    classes as inert stand-ins); `{}` where there is none."""
    if not (folder / "common.pt").exists():
        return {}
    with closing(source_file(folder, "common.pt", "SRC's")) as file:
        return _load(file)


def checkpoint_folder(src: Path) -> Path:
    """SRC itself, or for a Megatron-LM save folder the iteration its `latest_checkpointed_iteration.txt` names."""
    tracker = src / "latest_checkpointed_iteration.txt"
    if dcp_files(src) or not tracker.exists():
        return src
    with closing(source_file(src, tracker.name, "SRC's")) as file:
        text = file.read_text().strip()
    if not text.isdigit():
        raise ConversionError(f"SRC's {tracker.name} says {text!r}, not an iteration number (e.g. 1000).")
    return src / f"iter_{int(text):07d}"


def open_megatron(src: Path, allow_pickle: bool = False) -> Checkpoint:
    """`Reading.open`: SRC's torch_dist checkpoint, or its legacy `torch` one (`LegacyCheckpoint`, with
    `allow_pickle`), its `config` Megatron-LM's arguments (`ARGS`) from `common.pt` (the legacy files') or SRC's
    config.json."""
    folder = checkpoint_folder(src)
    if dcp_files(folder):
        ckpt, args = DcpCheckpoint(folder, {}), read_common(folder).get("args")
    elif LegacyCheckpoint.ranks(folder):
        ckpt = LegacyCheckpoint(folder, allow_pickle)
        args = ckpt.args
    else:
        raise ConversionError(f"SRC {str(src)!r} is not a Megatron checkpoint: it has no {METADATA} (torch_dist) and "
                              f"no mp_rank_*/{LEGACY_FILE} (the legacy torch format).")
    given = "the checkpoint's args"
    if args is None:
        if not (folder / "config.json").exists():
            raise ConversionError(
                "SRC's common.pt has no `args` (a megatron-core save): give the model's shape in a config.json in "
                "SRC with Megatron-LM's argument names, e.g. {\"num_layers\": 24, \"hidden_size\": 2048, "
                "\"num_attention_heads\": 16, \"group_query_attention\": true, \"num_query_groups\": 4, "
                "\"kv_channels\": 128, \"ffn_hidden_size\": 6144, \"normalization\": \"RMSNorm\", \"swiglu\": true, "
                "\"add_bias_linear\": false, \"qk_layernorm\": true, \"attention_output_gate\": true, "
                "\"position_embedding_type\": \"rope\", \"untie_embeddings_and_output_weights\": true} (docs/conversion.md).")
        with closing(source_file(folder, "config.json", "SRC's")) as file:
            args, given = read_json_object(file, "SRC's config.json", ConversionError), "SRC's config.json"
    elif not isinstance(args, argparse.Namespace):
        raise ConversionError("SRC's `args` are not Megatron-LM's arguments (an argparse.Namespace).")
    else:
        args = vars(args)
    config = {key: args.get(key, default) for key, default in ARGS.items()}
    if config["padded_vocab_size"] is None and EMBEDDING in ckpt.tensors:
        config["padded_vocab_size"] = ckpt.tensors[EMBEDDING].shape[0]
    ckpt.config = dict(config, model_type=NAME, given=given, absent=sorted(k for k in ARGS if k not in args))
    if isinstance(ckpt, LegacyCheckpoint):
        ckpt.check_ranks()
    return ckpt


LEGACY_FILE = "model_optim_rng.pt"
# The legacy format's per-layer names (Megatron's local layer spec) of what torch_dist names by the fused layer.
LEGACY_NAMES = {"input_layernorm.weight": INPUT_NORM, "pre_mlp_layernorm.weight": MLP_NORM}
# The dimension tensor-parallel ranks split a tensor along (the others are the same on every rank).
TP_DIM = {EMBEDDING: 0, OUTPUT: 0, QKV: 0, FC1: 0, PROJ: 1, FC2: 1}


class LegacyCheckpoint(Checkpoint):
    """Megatron-LM's legacy `torch` checkpoint (`mp_rank_0N/model_optim_rng.pt`, one pickle per tensor-parallel rank,
    per-layer names), seen as the torch_dist layout: per-layer tensors stacked under its names, the ranks' shards
    merged (`linear_fc1`'s `[gate; up]` per rank regrouped). Read with `torch.load(weights_only=True)`, memory-mapped,
    only with `allow_pickle` (as pickled weights are); pipeline-parallel saves are refused."""

    @staticmethod
    def ranks(folder: Path) -> list[str]:
        return sorted(path.name for path in folder.glob("mp_rank_*") if (path / LEGACY_FILE).exists())

    def __init__(self, folder: Path, allow_pickle: bool):
        self.folder, self.pickled, self._cached, self.config = folder, True, None, {}
        ranks = self.ranks(folder)
        if any(len(rank.split("_")) > 3 for rank in ranks):
            raise ConversionError(f"SRC is a pipeline-parallel legacy checkpoint ({ranks[:2]}...); save it with "
                                  "--ckpt-format torch_dist (any parallelism), which this converter reads.")
        if not allow_pickle:
            raise ConversionError(f"SRC holds Megatron-LM's legacy torch checkpoint ({ranks[0]}/{LEGACY_FILE}: pickled "
                                  "weights); unpickling a file can run code from it. Pass --allow-pickle (Python: "
                                  "allow_pickle=True) to read it with torch.load(weights_only=True).")
        self.files = {rank: source_file(folder, f"{rank}/{LEGACY_FILE}", "SRC's") for rank in ranks}
        self.read = list(self.files.values())  # what `check_unchanged` holds SRC to
        states = [_load(file) for file in self.files.values()]
        self.args = states[0].get("args")
        self.models = [state.get("model") or {} for state in states]
        self.parts: dict[str, dict[int | None, str]] = {}  # name as torch_dist has it -> {layer: legacy name}
        for name, value in self.models[0].items():
            if isinstance(value, torch.Tensor):
                stacked, layer = _stacked_name(name)
                self.parts.setdefault(stacked, {})[layer] = name
        self.tensors = {}
        for name, layers in self.parts.items():
            first = self._merged(layers[min(layers, key=lambda k: -1 if k is None else k)], name)
            shape = tuple(first.shape) if None in layers else (len(layers), *first.shape)
            self.tensors[name] = TensorInfo(ranks[0], shape, first.dtype)

    def check_ranks(self) -> None:
        """Refuses a save whose rank files are fewer than its arguments say (a missing shard)."""
        saved = getattr(self.args, "tensor_model_parallel_size", len(self.files)) if self.args else len(self.files)
        if saved != len(self.files):
            raise ConversionError(f"SRC's args say tensor_model_parallel_size={saved} but SRC has {len(self.files)} "
                                  f"rank file(s) ({sorted(self.files)}): a shard of the save is missing.")

    def _merged(self, legacy: str, name: str) -> torch.Tensor:
        shards = [model[legacy] for model in self.models]
        suffix = name.removeprefix(LAYERS)
        dim = TP_DIM.get(suffix, TP_DIM.get(name))
        if dim is None or len(shards) == 1:
            return shards[0]
        if suffix == FC1:  # each rank holds [its gate rows; its up rows]
            halves = [shard.chunk(2) for shard in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        return torch.cat(shards, dim=dim)

    def layer(self, name: str, index: int) -> torch.Tensor:
        return self._merged(self.parts[name][index], name).clone()

    def get(self, name: str) -> torch.Tensor:
        layers = self.parts[name]
        if None in layers:
            return self._merged(layers[None], name).clone()
        return torch.stack([self._merged(layers[i], name) for i in sorted(layers)])

    @property
    def largest_file_bytes(self) -> int:
        return max(file.size for file in self.files.values())


def _stacked_name(name: str) -> tuple[str, int | None]:
    """A legacy per-layer name -> (its torch_dist name, its layer), e.g. `decoder.layers.3.input_layernorm.weight` ->
    (`decoder.layers.self_attention.linear_qkv.layer_norm_weight`, 3); other names as they are, layer None."""
    parts = name.split(".")
    if name.startswith(LAYERS) and len(parts) > 3 and parts[2].isdigit():
        suffix = ".".join(parts[3:])
        return LAYERS + LEGACY_NAMES.get(suffix, suffix), int(parts[2])
    return name, None


def _load(file) -> dict:
    allowed = [argparse.Namespace, types.SimpleNamespace, PosixPath, io.BytesIO, signal.Signals,
               *((_Foreign, name) for name in MEGATRON_CLASSES)]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(file.path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        raise ConversionError(f"SRC's {file} cannot be read with torch.load(weights_only=True) "
                              f"({unpickling_reason(error)}).") from None
    if not isinstance(state, dict):
        raise ConversionError(f"SRC's {file} does not hold Megatron-LM's checkpoint (a dict with `model`).")
    return state


def _field(cfg: dict, key: str) -> str:
    where = f"Megatron-LM's default, absent from {cfg['given']}" if key in cfg["absent"] else cfg["given"]
    return f"{key}={cfg[key]!r} ({where})"


def check_args(cfg: dict) -> None:
    """Refuses, naming the field, what GatedQwen cannot compute."""
    missing = [key for key in REQUIRED if not isinstance(cfg[key], int) or isinstance(cfg[key], bool)]
    if missing:
        raise CheckpointFormatError(f"{cfg['given']} does not give {missing} (whole numbers), which the model's shape "
                                    "needs.")
    refusals = [
        ("multi_latent_attention", lambda v: v, "multi-latent attention (MLA), which GatedQwen does not have"),
        ("experimental_attention_variant", lambda v: v is not None,
         "linear-attention (Gated DeltaNet) or other attention layers, which GatedQwen does not have"),
        ("num_experts", lambda v: v, "a mixture of experts, whose Megatron layout is not mapped here"),
        ("add_bias_linear", lambda v: v, "biases on the linear layers, which GatedQwen's dense model does not have "
                                         "(set it false where the model has none)"),
        ("add_qkv_bias", lambda v: v, "q/k/v biases, which this format does not map"),
        ("normalization", lambda v: v != "RMSNorm", "not RMSNorm, GatedQwen's norm"),
        ("swiglu", lambda v: not v, "an MLP other than SwiGLU, GatedQwen's"),
        ("position_embedding_type", lambda v: v != "rope", "positions other than RoPE"),
        ("rotary_interleaved", lambda v: v, "interleaved RoPE (pairs of adjacent features), not GatedQwen's halves"),
        ("rotary_percent", lambda v: v != 1.0, "RoPE on part of each head; GatedQwen rotates the whole head"),
        ("use_rope_scaling", lambda v: v, "scaled RoPE, which this format does not map"),
        ("apply_residual_connection_post_layernorm", lambda v: v, "a residual taken after the norm"),
    ]
    for key, refused, why in refusals:
        if refused(cfg[key]):
            raise CheckpointFormatError(f"{_field(cfg, key)}: {why}; nothing was written.")


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of the tensors of the Megatron GPT model that Megatron-LM's arguments `cfg` describe."""
    check_args(cfg)
    layers, hidden, heads, groups, head_dim, ffn, vocab = sizes(cfg)
    per_group = (2 if cfg["attention_output_gate"] else 1) * heads // groups + 2
    out = {EMBEDDING: (vocab, hidden), FINAL_NORM: (hidden,)}
    out.update({LAYERS + name: (layers, *shape) for name, shape in {
        INPUT_NORM: (hidden,), QKV: (groups * per_group * head_dim, hidden), PROJ: (hidden, heads * head_dim),
        MLP_NORM: (hidden,), FC1: (2 * ffn, hidden), FC2: (hidden, ffn)}.items()})
    if cfg["qk_layernorm"]:
        out.update({LAYERS + QNORM: (layers, head_dim), LAYERS + KNORM: (layers, head_dim)})
    if cfg["untie_embeddings_and_output_weights"]:
        out[OUTPUT] = (vocab, hidden)
    return out


def sizes(cfg: dict) -> tuple[int, ...]:
    """`(layers, hidden, heads, query groups, head_dim, ffn, vocab)` of Megatron-LM's arguments."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    groups = cfg["num_query_groups"] if cfg["group_query_attention"] else heads
    return (cfg["num_layers"], hidden, heads, groups, cfg["kv_channels"] or hidden // heads,
            cfg["ffn_hidden_size"] or 4 * hidden, cfg["padded_vocab_size"])


def config_fields(cfg: dict, gate: dict | None = None) -> dict:
    """GatedQwen's config fields of Megatron-LM's arguments (`Reading.config_fields`)."""
    check_args(cfg)
    layers, hidden, heads, groups, head_dim, ffn, vocab = sizes(cfg)
    dtype = "bfloat16" if cfg["bf16"] else "float16" if cfg["fp16"] else "float32"
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=groups, head_dim=head_dim, hidden_act="silu",
                  rms_norm_eps=cfg["norm_epsilon"], tie_word_embeddings=not cfg["untie_embeddings_and_output_weights"],
                  rope_parameters={"rope_type": "default", "rope_theta": float(cfg["rotary_base"])},
                  use_qk_norm=bool(cfg["qk_layernorm"]), attention_bias=False, dtype=dtype,
                  gate_position="sdpa" if cfg["attention_output_gate"] else None, gate_granularity="elementwise")
    if cfg["max_position_embeddings"]:
        fields["max_position_embeddings"] = cfg["max_position_embeddings"]
    return fields


def check_tensors(cfg: dict, config, found: dict[str, tuple[int, ...]]) -> None:
    """`Reading.check`: refuses tensors of layers GatedQwen does not have, a layer count that disagrees with the
    stacked tensors, and an untied model without its output layer, before anything is read."""
    for name in found:
        what = next((what for part, what in FOREIGN.items() if f".{part}" in name), None)
        if what:
            raise CheckpointFormatError(f"SRC holds {name}: {what}, which GatedQwen does not have; nothing was written.")
    stacked = LAYERS + QKV
    if stacked in found and found[stacked][0] != cfg["num_layers"]:
        raise CheckpointFormatError(f"{stacked} stacks {found[stacked][0]} layers, but {_field(cfg, 'num_layers')}; "
                                    "the arguments and the tensors disagree. Nothing was written.")
    if cfg["untie_embeddings_and_output_weights"] and OUTPUT not in found:
        raise CheckpointFormatError(f"{_field(cfg, 'untie_embeddings_and_output_weights')} but SRC has no {OUTPUT}: "
                                    "the output layer is missing (a checkpoint of the first pipeline stage only?).")


def split_qkv(qkv: torch.Tensor, config, gated: bool) -> dict[str, torch.Tensor]:
    """One layer's `linear_qkv` `[G·(2·H/G + 2)·D, hidden]` (without a gate `[G·(H/G + 2)·D, hidden]`) -> GatedQwen's
    `q_proj [H·D]`, `gate.g_proj [H·D]` (gated), `k_proj [G·D]`, `v_proj [G·D]` rows."""
    heads, groups, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    per_head = (2 if gated else 1) * heads // groups * head_dim
    rows = qkv.view(groups, per_head + 2 * head_dim, -1)
    q, k, v = rows.split([per_head, head_dim, head_dim], dim=1)
    out = {"k_proj": k.reshape(-1, k.shape[-1]), "v_proj": v.reshape(-1, v.shape[-1])}
    if gated:
        q, gate = q.view(groups, 2, -1, q.shape[-1]).unbind(1)
        out["gate.g_proj"] = gate.reshape(-1, gate.shape[-1])
    out["q_proj"] = q.reshape(-1, q.shape[-1])
    return {f"self_attn.{name}.weight": tensor.contiguous() for name, tensor in out.items()}


def plan_import(ckpt: DcpCheckpoint, config) -> dict[str, TensorPlan]:
    """`Reading.plan`: GatedQwen's tensors of the Megatron checkpoint, one layer of a stacked tensor read at a time;
    refuses tensors this format does not know."""
    known = set(shapes(ckpt.config))
    unknown = sorted(name for name in ckpt.tensors if name not in known and not name.startswith(IGNORED))
    if unknown:
        raise ConversionError(f"SRC has tensors a Megatron GPT model of its arguments does not have: {unknown[:6]}; "
                              "nothing was written.")
    one_p = 1.0 if ckpt.config["apply_layernorm_1p"] else 0.0
    gated = config.gate_position is not None

    def tensor(name, shape, index=None, make=lambda t: t):
        dtype = ckpt.tensors[name].dtype
        read = (lambda: ckpt.get(name)) if index is None else (lambda: ckpt.layer(name, index))
        return TensorPlan(tuple(shape), dtype, lambda: make(read()))

    def norm(name, shape, index=None):
        return tensor(name, shape, index, lambda w: (w.float() + one_p).to(w.dtype) if one_p else w)

    hidden, head_dim, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    plan = {"model.embed_tokens.weight": tensor(EMBEDDING, ckpt.tensors[EMBEDDING].shape),
            "model.norm.weight": norm(FINAL_NORM, (hidden,))}
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = tensor(OUTPUT, ckpt.tensors[OUTPUT].shape)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        plan[p + "input_layernorm.weight"] = norm(LAYERS + INPUT_NORM, (hidden,), i)
        plan[p + "post_attention_layernorm.weight"] = norm(LAYERS + MLP_NORM, (hidden,), i)
        if config.use_qk_norm:
            plan[p + "self_attn.q_norm.weight"] = norm(LAYERS + QNORM, (head_dim,), i)
            plan[p + "self_attn.k_norm.weight"] = norm(LAYERS + KNORM, (head_dim,), i)
        attn_rows = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads,
                     "v_proj": config.num_key_value_heads, **({"gate.g_proj": config.num_attention_heads} if gated else {})}
        for name, heads in attn_rows.items():
            target = f"self_attn.{name}.weight"
            plan[p + target] = tensor(LAYERS + QKV, (heads * head_dim, hidden), i,
                                      lambda w, target=target: split_qkv(w, config, gated)[target])
        plan[p + "self_attn.o_proj.weight"] = tensor(LAYERS + PROJ, (hidden, config.num_attention_heads * head_dim), i)
        for half, name in enumerate(("gate_proj", "up_proj")):
            plan[p + f"mlp.{name}.weight"] = tensor(LAYERS + FC1, (ffn, hidden), i,
                                                    lambda w, half=half: w[half * ffn:(half + 1) * ffn].contiguous())
        plan[p + "mlp.down_proj.weight"] = tensor(LAYERS + FC2, (hidden, ffn), i)
    return plan


# ------------------------------------------------------------------------------------------------------ the model
def megatron_logits(ckpt: DcpCheckpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` of the checkpoint as Megatron-core's GPT model computes
    them, written from its layout (the reference of `--verify`; Megatron's own forward: `make test-engines`)."""
    cfg = ckpt.config
    layers, hidden, heads, groups, head_dim, ffn, vocab = sizes(cfg)
    w = {name: ckpt.get(name).float() for name in shapes(cfg)}
    if cfg["apply_layernorm_1p"]:
        w = {name: t + 1 if "norm" in name else t for name, t in w.items()}
    batch, seq = input_ids.shape
    inv = 1.0 / cfg["rotary_base"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [S, D]
    eps, per_group = cfg["norm_epsilon"], heads // groups

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):  # [B, S, N, D]
        half = head_dim // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    mask = torch.full((seq, seq), float("-inf")).triu(1)
    h = w[EMBEDDING][input_ids]
    for i in range(layers):
        x = rms(h, w[LAYERS + INPUT_NORM][i])
        mixed = (x @ w[LAYERS + QKV][i].T).view(batch, seq, groups, -1)
        parts = [per_group * head_dim] * (2 if cfg["attention_output_gate"] else 1) + [head_dim, head_dim]
        q, *gate, k, v = mixed.split(parts, dim=-1)
        q = q.reshape(batch, seq, heads, head_dim)
        if cfg["qk_layernorm"]:
            q, k = rms(q, w[LAYERS + QNORM][i]), rms(k, w[LAYERS + KNORM][i])
        q, k = rope(q).transpose(1, 2), rope(k).repeat_interleave(per_group, 2).transpose(1, 2)
        v = v.repeat_interleave(per_group, 2).transpose(1, 2)
        attn = ((q @ k.transpose(2, 3)) / math.sqrt(head_dim) + mask).softmax(-1) @ v  # [B, N, S, D]
        attn = attn.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        if gate:
            attn = attn * torch.sigmoid(gate[0].reshape(batch, seq, -1))
        h = h + attn @ w[LAYERS + PROJ][i].T
        up = rms(h, w[LAYERS + MLP_NORM][i]) @ w[LAYERS + FC1][i].T
        h = h + (torch.nn.functional.silu(up[..., :ffn]) * up[..., ffn:]) @ w[LAYERS + FC2][i].T
    head = w[OUTPUT] if cfg["untie_embeddings_and_output_weights"] else w[EMBEDDING]
    return rms(h, w[FINAL_NORM]) @ head.T


# ------------------------------------------------------------------------------------------------------ export
def megatron_args(config) -> dict:
    """Megatron-LM's arguments of a GatedQwen config (what `common.pt`'s `args` holds)."""
    dtype = str(config.dtype).removeprefix("torch.") if config.dtype else "float32"
    return dict(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size, ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, group_query_attention=True,
        num_query_groups=config.num_key_value_heads, kv_channels=config.head_dim,
        padded_vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
        position_embedding_type="rope", rotary_base=config.rope_parameters["rope_theta"], rotary_percent=1.0,
        rotary_interleaved=False, use_rope_scaling=False, normalization="RMSNorm", norm_epsilon=config.rms_norm_eps,
        apply_layernorm_1p=False, qk_layernorm=config.use_qk_norm, swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        attention_output_gate=config.gate_position is not None, multi_latent_attention=False, num_experts=None,
        bf16=dtype == "bfloat16", fp16=dtype == "float16", tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, ckpt_format="torch_dist", vocab_size=config.vocab_size)


def check_exportable(config) -> None:
    """What Megatron's GPT model cannot compute of a GatedQwen model."""
    check_g1_sigmoid(config, "Megatron-core's attention output gate")
    rope = {k: v for k, v in config.rope_parameters.items() if v is not None and k != "partial_rotary_factor"}
    problems = [
        (config.attention_bias or config.gate_bias, "biases (attention_bias or gate_bias); Megatron's add_qkv_bias "
                                                   "has no o_proj bias and no gate bias"),
        (rope.get("rope_type", "default") != "default", f"rope_parameters={config.rope_parameters}: Megatron's RoPE "
                                                        "here is the default one"),
        (config.hidden_act != "silu", f"hidden_act={config.hidden_act!r}: Megatron's MLP here is SwiGLU"),
        (any(t != "full_attention" for t in config.layer_types), "sliding-window layers"),
    ]
    for refused, why in problems:
        if refused:
            raise ConversionError(f"Megatron-core's GPT model cannot hold {why}; nothing was written.")


def _qkv_rows(q: TensorPlan, gate: TensorPlan | None, k: TensorPlan, v: TensorPlan, groups: int) -> TensorPlan:
    """Megatron's `linear_qkv` of one layer: per query group `[queries | gate rows | k | v]`."""
    parts = [q, *([gate] if gate is not None else []), k, v]
    shape = (sum(p.shape[0] for p in parts), q.shape[1])
    return TensorPlan(shape, q.dtype, lambda: torch.cat(
        [p.make().to(q.dtype).view(groups, -1, shape[1]) for p in parts], dim=1).reshape(shape))


def write(ckpt: Checkpoint, path: Path) -> tuple[int, str]:
    """`FileWriting.write`: the gated_qwen checkpoint as Megatron-core's torch_dist checkpoint in the new folder
    `path`, with `common.pt` (Megatron-LM's arguments) and `metadata.json`."""
    config = load_gated_config(ckpt)
    check_exportable(config)
    tmap, layers, groups = TensorMap(ckpt), config.num_hidden_layers, config.num_key_value_heads
    stacked = {name: [] for name in (INPUT_NORM, QKV, PROJ, MLP_NORM, FC1, FC2)}
    if config.use_qk_norm:
        stacked.update({QNORM: [], KNORM: []})
    gated = config.gate_position is not None
    for i in range(layers):
        p = f"model.layers.{i}."
        gate = o_proj = None
        if gated:
            gate, _, o_proj = g1_gate_rows(tmap, config, i, width=config.head_dim, with_bias=False)
        q, k, v = (tmap.take(p + f"self_attn.{n}_proj.weight") for n in "qkv")
        stacked[QKV].append(_qkv_rows(q, gate, k, v, groups))
        stacked[PROJ].append(o_proj or tmap.take(p + "self_attn.o_proj.weight"))
        stacked[INPUT_NORM].append(tmap.take(p + "input_layernorm.weight"))
        stacked[MLP_NORM].append(tmap.take(p + "post_attention_layernorm.weight"))
        if config.use_qk_norm:
            stacked[QNORM].append(tmap.take(p + "self_attn.q_norm.weight"))
            stacked[KNORM].append(tmap.take(p + "self_attn.k_norm.weight"))
        up, gate_proj = tmap.take(p + "mlp.up_proj.weight"), tmap.take(p + "mlp.gate_proj.weight")
        stacked[FC1].append(TensorPlan((2 * up.shape[0], up.shape[1]), up.dtype,
                                       lambda g=gate_proj, u=up: torch.cat([g.make(), u.make()])))
        stacked[FC2].append(tmap.take(p + "mlp.down_proj.weight"))
    entries = {LAYERS + name: parts for name, parts in stacked.items()}
    entries[EMBEDDING], entries[FINAL_NORM] = tmap.take("model.embed_tokens.weight"), tmap.take("model.norm.weight")
    if not config.tie_word_embeddings:
        entries[OUTPUT] = tmap.take("lm_head.weight")
    elif tmap.has("lm_head.weight"):
        tmap.drop("lm_head.weight")
    tmap.finish()
    empty = io.BytesIO()
    torch.save([None], empty)  # a local linear layer's extra state, as Megatron saves it
    entries.update({f"{LAYERS}{module}._extra_state/shard_{i}_{layers}": empty.getvalue()
                    for module in EXTRA_STATES for i in range(layers)})
    write_dcp(path, entries)
    args = argparse.Namespace(**megatron_args(config))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 0}, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    if gated and config.gate_granularity == "headwise":
        say("headwise gate written as elementwise gate rows (each head's row repeated head_dim times): Megatron-core "
            "computes the same logits, and training there unties the repeated rows.")
    return config.vocab_size, f"Megatron-core torch_dist checkpoint, {layers} layers stacked, TP-size independent"


MEGATRON = Format(
    NAME, "Megatron-core's torch_dist checkpoint (torch DCP), GPT with the attention output gate; its shape from "
    "common.pt's args, else a config.json of Megatron-LM's argument names in SRC",
    reading=Reading((NAME,), config_fields, detect=lambda config: False, check=check_tensors, open=open_megatron,
                    plan=plan_import),
    writing=FileWriting(write, lambda path, ids: megatron_logits(open_megatron(path), ids), folder=True),
    model=OwnModel(shapes, megatron_logits))
