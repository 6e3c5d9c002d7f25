"""ONNX, for ONNX Runtime (CPU, mobile, and the web through onnxruntime-web and Transformers.js): a GatedQwen or
GatedQwen-MoE model as one decoder graph with its KV cache, in the layout Optimum's `text-generation-with-past`
export writes (`pip install 'gated-qwen[onnx]'`).

The folder holds `model.onnx` (the weights inside it, or beside it in `model.onnx_data` past ONNX's 2 GB), SRC's
config.json (less `auto_map`: the folder has no model code), and its tokenizer and generation files. The graph's
inputs are `input_ids`, `attention_mask` (past and new tokens), `position_ids` and `past_key_values.{i}.key` /
`.value` (`[batch, kv heads, past, head_dim]`, empty for the first call), its outputs `logits` and
`present.{i}.key` / `.value`, all float32: what Optimum's `ORTModelForCausalLM` and Transformers.js feed a decoder.
It is traced from the model itself (PyTorch's ONNX exporter, TorchScript mode, opset 18), so every variant the model
computes is in it, gate included; a mixture of experts is traced with Transformers' `batched_mm` experts (each
token's experts gathered, no branch on the routing that a trace would freeze).

Optimum's own exporter (optimum-onnx 0.1.0, its latest release) is not what writes it: that release requires
Transformers < 4.58 and this package Transformers 5, and its exporter and `ORTModelForCausalLM` know architectures
by name only (docs/local.md says what was tried). `--verify` runs the graph in ONNX Runtime against the source in
Transformers; `make test-onnx` (tests/engine_onnx) checks generation with the KV cache and the int8 quantization.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch
from transformers.cache_utils import DynamicCache
from transformers.initialization import no_init_weights

from ...files import write_json
from ...model.configuration_gated_moe import GatedQwenMoeConfig
from ...model.modeling_gated import GatedQwenForCausalLM
from ...model.modeling_gated_moe import GatedQwenMoeForCausalLM
from ..errors import ConversionError, import_extra
from ..export_steps import load_gated_config
from ..format_types import FileWriting, Format
from ..io import Checkpoint, return_freed_memory

OPSET = 18
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx_data"
EXTERNAL_DATA_BYTES = 2**31 - 2**26  # past this the weights go beside the graph (a protobuf holds at most 2 GiB)


def _onnxruntime():
    return import_extra("onnxruntime", "--to onnx checks what it writes with ONNX Runtime, which is not installed: "
                                       "pip install 'gated-qwen[onnx]' (or pip install onnx onnxruntime).")


def input_names(layers: int) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids",
            *(f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]


def output_names(layers: int) -> list[str]:
    return ["logits", *(f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value"))]


def dynamic_axes(layers: int) -> dict[str, dict[int, str]]:
    """Optimum's names for the axes that vary: batch and lengths."""
    axes = {"input_ids": {0: "batch_size", 1: "sequence_length"},
            "position_ids": {0: "batch_size", 1: "sequence_length"},
            "attention_mask": {0: "batch_size", 1: "past_sequence_length + sequence_length"},
            "logits": {0: "batch_size", 1: "sequence_length"}}
    for name in input_names(layers)[3:]:
        axes[name] = {0: "batch_size", 2: "past_sequence_length"}
    for name in output_names(layers)[1:]:
        axes[name] = {0: "batch_size", 2: "past_sequence_length + sequence_length"}
    return axes


# ------------------------------------------------------------------------------------------------------ the model
def load_model(ckpt: Checkpoint):
    """The GatedQwen / GatedQwen-MoE model of `ckpt` in float32 (SDPA; a mixture of experts with `batched_mm`
    experts), its weights read through the checkpoint's checked files (one tensor per expert on disk stacked as
    the model holds them)."""
    config = load_gated_config(ckpt, moe=True)
    sliding = [i for i, kind in enumerate(config.layer_types) if kind != "full_attention"]
    if sliding:
        raise ConversionError(f"layers {sliding} of this model are {config.layer_types[sliding[0]]!r}: a traced "
                              "sliding-window mask keeps the lengths it was traced with, so --to onnx writes models "
                              "whose layers are all full attention; nothing was written.")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ConversionError(f"rope_parameters has rope_type={rope_type!r}, whose frequencies change with the "
                              "sequence's length as the model runs: a trace keeps those of the lengths it was traced "
                              "with, so --to onnx refuses it; nothing was written.")
    moe = isinstance(config, GatedQwenMoeConfig)
    if moe:
        config._experts_implementation = "batched_mm"
    with no_init_weights():
        model = (GatedQwenMoeForCausalLM if moe else GatedQwenForCausalLM)(config).float()
    missing, unexpected = model.load_state_dict(_state_dict(ckpt), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise ConversionError(f"SRC's tensors do not fill {type(model).__name__} (missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}); nothing was written.")
    model.tie_weights()
    return model.eval()


def _state_dict(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """SRC's tensors in float32 under the model's in-memory names: one tensor per expert on disk (what
    `save_pretrained` writes) stacked into the experts' `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]`."""
    state, experts = {}, {}
    for name in ckpt.tensors:
        found = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if found:
            experts.setdefault(found[1], {})[(int(found[2]), found[3])] = name
        else:
            state[name] = ckpt.get(name).float()
    for prefix, names in experts.items():
        count = 1 + max(expert for expert, _ in names)

        def stack(kind, names=names, count=count):
            return torch.stack([ckpt.get(names[(e, kind)]).float() for e in range(count)])

        state[prefix + ".gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        state[prefix + ".down_proj"] = stack("down")
    return state


def _flat(model):
    """The model with Optimum's decoder signature: flat tensors in (ids, mask, positions, the past keys and values
    layer by layer), flat tensors out (logits, then the present keys and values)."""
    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            cache = DynamicCache(config=model.config)
            for layer in range(len(past) // 2):
                cache.update(past[2 * layer], past[2 * layer + 1], layer)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True)
            present = []
            for layer in out.cache.layers:
                present += [layer.keys, layer.values]
            return (out.logits, *present)

    return Flat()


def _example(config) -> tuple:
    """Inputs to trace with: 2 sequences of 3 new tokens after 4 cached ones (every axis that varies above 1)."""
    batch, new, past = 2, 3, 4
    ids = torch.randint(0, config.vocab_size, (batch, new), generator=torch.Generator().manual_seed(0))
    cached = [torch.zeros(batch, config.num_key_value_heads, past, config.head_dim)
              for _ in range(2 * config.num_hidden_layers)]
    return (ids, torch.ones(batch, past + new, dtype=torch.long), torch.arange(past, past + new).expand(batch, new),
            *cached)


# ------------------------------------------------------------------------------------------------------ writing
def write(ckpt: Checkpoint, folder: Path) -> tuple[int, str]:
    """`gated-qwen convert SRC DST --to onnx` (`FileWriting.write`, a folder): `model.onnx` traced from SRC's model and
    SRC's config.json into `folder`, the graph's inputs and outputs checked by ONNX Runtime; returns the vocabulary
    size and the line that reports it."""
    _onnxruntime()
    model = load_model(ckpt)
    layers, vocab_size, model_type = model.config.num_hidden_layers, model.config.vocab_size, model.config.model_type
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it freezes (--verify runs other shapes)
        torch.onnx.export(_flat(model), _example(model.config), str(folder / MODEL_FILE), input_names=input_names(layers),
                          output_names=output_names(layers), dynamic_axes=dynamic_axes(layers), opset_version=OPSET,
                          dynamo=False)
    weights = sum(p.numel() * 4 for p in model.parameters())  # a tied embedding once
    del model
    gc.collect()  # the traced wrapper and the model refer to each other
    return_freed_memory()
    _finish_graph(folder, weights)
    return_freed_memory()
    write_json(folder / "config.json", {k: v for k, v in ckpt.config.items() if k != "auto_map"})  # no code here
    check_graph(folder)
    where = f"weights in {DATA_FILE}" if (folder / DATA_FILE).exists() else "weights inside"
    return vocab_size, (f"{MODEL_FILE}: {model_type}, {layers} layers, {weights // 4:,} parameters in float32 "
                        f"({where}), KV cache inputs and outputs")


def _finish_graph(folder: Path, weights: int) -> None:
    """The exported graph as written: a tied embedding stored once (the exporter folds the lm_head's transpose of it
    into a second copy, which becomes a Transpose of the one embedding), and past `EXTERNAL_DATA_BYTES` of weights
    the initializers in one `DATA_FILE` beside the graph, each at a page boundary (PyTorch's exporter writes a file
    per tensor when its own graph passes 2 GiB; Optimum and ONNX Runtime read one file). The exporter's files are
    read mapped and copied, never loaded: the weights are in memory once, in ONNX Runtime's check."""
    import onnx  # the onnx extra (installed with onnxruntime)
    from onnx import external_data_helper, helper, numpy_helper

    graph = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    initializers = graph.graph.initializer

    def values(tensor) -> np.ndarray:
        if not external_data_helper.uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        return np.memmap(folder / external_data_helper.ExternalDataInfo(tensor).location, mode="r",
                         dtype=helper.tensor_dtype_to_np_dtype(tensor.data_type), shape=tuple(tensor.dims))

    embedding = next((i for i in initializers if i.name.endswith("embed_tokens.weight")), None)
    if embedding is not None and len(embedding.dims) == 2:
        rows = values(embedding)
        for copy in [i for i in initializers if list(i.dims) == list(reversed(embedding.dims)) and i is not embedding]:
            if np.array_equal(values(copy), rows.T):
                initializers.remove(copy)
                graph.graph.node.insert(0, helper.make_node("Transpose", [embedding.name], [copy.name], perm=[1, 0]))
        del rows
    exported = [i for i in initializers if external_data_helper.uses_external_data(i)]
    if exported:
        with open(folder / DATA_FILE, "wb") as data:
            for tensor in exported:
                data.write(bytes(-data.tell() % 4096))
                offset = data.tell()
                with open(folder / external_data_helper.ExternalDataInfo(tensor).location, "rb") as part:
                    shutil.copyfileobj(part, data, 2**24)
                del tensor.external_data[:]
                for key, value in (("location", DATA_FILE), ("offset", offset), ("length", data.tell() - offset)):
                    tensor.external_data.add(key=key, value=str(value))
        for path in set(folder.iterdir()) - {folder / MODEL_FILE, folder / DATA_FILE}:
            path.unlink()  # the exporter's files of one tensor each, and the copy of the embedding
        onnx.save_model(graph, str(folder / MODEL_FILE))
    elif weights <= EXTERNAL_DATA_BYTES:
        onnx.save_model(graph, str(folder / MODEL_FILE))
    else:
        onnx.save_model(graph, str(folder / MODEL_FILE), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=DATA_FILE, size_threshold=1024)


def session(folder: Path, file: str = MODEL_FILE):
    """An ONNX Runtime session of the folder's graph on the CPU, its weights not pre-packed (a second copy of each
    matrix) and without a memory arena: the checks run a few sequences, and a model of 1.7B parameters fits in
    memory once, not twice."""
    onnxruntime = _onnxruntime()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.disable_prepacking", "1")
    options.enable_cpu_mem_arena = False  # an arena keeps what it grew to
    return onnxruntime.InferenceSession(str(folder / file), options, providers=["CPUExecutionProvider"])


def check_graph(folder: Path) -> None:
    """The graph holds exactly Optimum's decoder inputs and outputs for the folder's config.json."""
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    graph = session(folder)
    found = ([i.name for i in graph.get_inputs()], [o.name for o in graph.get_outputs()])
    if found != (input_names(layers), output_names(layers)):
        raise ConversionError(f"the ONNX graph written has inputs {found[0][:5]} and outputs {found[1][:3]}, not "
                              "the decoder's; nothing was written.")


def empty_past(config: dict, batch: int) -> dict:
    shape = (batch, config["num_key_value_heads"], 0, config["head_dim"])
    return {name: np.zeros(shape, np.float32) for name in input_names(config["num_hidden_layers"])[3:]}


def onnx_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` computed by ONNX Runtime from the folder's graph (no
    past): the `--verify` of `--to onnx`."""
    config = json.loads((Path(folder) / "config.json").read_text())
    batch, length = input_ids.shape
    feed = {"input_ids": input_ids.numpy().astype(np.int64), "attention_mask": np.ones((batch, length), np.int64),
            "position_ids": np.tile(np.arange(length), (batch, 1)), **empty_past(config, batch)}
    return torch.from_numpy(session(Path(folder)).run(["logits"], feed)[0]).float()


ONNX = Format(
    "onnx", "a folder for ONNX Runtime (Optimum's decoder layout: model.onnx with its KV cache inputs and outputs, "
    "float32), every variant the model computes (docs/local.md)",
    writing=FileWriting(write, onnx_logits, folder=True))
