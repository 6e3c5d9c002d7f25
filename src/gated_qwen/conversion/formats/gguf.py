"""GGUF, the single-file format of llama.cpp (and llama-cpp-python, LM Studio, Ollama's llama.cpp engine): a GatedQwen
model as llama.cpp's Qwen3.5 architecture (`qwen35`), a GatedQwen-MoE as its Qwen3-Next one (`qwen3next`), written
with the `gguf` package (`pip install gated-qwen[gguf]`).

Those architectures' full-attention layer is GatedQwen's G1 gate: `q_proj` holds `[q_h | gate_h]` per head and the
attention output is multiplied by `sigmoid(gate)` before `o_proj`. The export composes the steps of
`export_steps.py` as `--to qwen3_5` / `--to qwen3_next` do (every G1 sigmoid gate written exactly as elementwise gate
rows, and those exports' refusals), under llama.cpp's names, with the RMSNorm weights as GatedQwen stores them
(llama.cpp computes `x̂·w`; its converter adds the 1 that Qwen3.5 checkpoints leave out) and each mixture-of-experts
layer's experts stacked into one tensor per projection.

One layer is added after the last: a Gated DeltaNet (linear-attention) layer whose output projections are zero, so
it adds exactly 0 to the residual stream and the model computes what the source computes. llama.cpp needs it: both
architectures keep a hybrid memory (a KV cache for the attention layers and a recurrent state for the others) and
fill the recurrent state's copy index (`rs_s_copy`) before every batch; with no recurrent layer no node reads that
input, so the graph allocator gives it no buffer, and `llm_graph_input_mem_hybrid::set_input` aborts at the first
token (`GGML_ASSERT(buffer) failed`, ggml-backend.cpp, in llama-cpp-python 0.3.36 and the newer llama.cpp
sources read for docs/local.md). The layer's state is small (one key and one value head of Qwen3.5's size, 128); its zero FFN
(or experts) cost one layer's worth of file. `tests/engine_llama` holds a strict expected-failure test that passes the day
llama.cpp runs a GGUF without it.

Refused, besides the export's refusals: an o_proj bias (`attention_bias`: llama.cpp's attention has none), RoPE
scaling (only the default RoPE is written), and for the mixture of experts dense layers (`mlp_only_layers`,
`decoder_sparse_step` > 1: llama.cpp's qwen3next has experts in every layer) and `norm_topk_prob=False` (it always
renormalises the top-k routing weights). The vocabulary comes from SRC's `tokenizer.json` (byte-level BPE with GPT-2's,
Qwen2's or Qwen3.5's pre-tokenizer, the ones llama.cpp names `gpt-2`, `qwen2` and `qwen35`); without one the GGUF has
no vocabulary (`no_vocab`: llama.cpp runs it on token ids).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

from ...files import read_json_object, scratch_folder
from ...model.configuration_gated_moe import GatedQwenMoeConfig
from .. import io
from ..errors import ConversionError, VerificationError, import_extra
from ..export_steps import (
    check_qwen3_5_attention,
    check_shared_expert,
    load_gated_config,
    qwen3_5_attention,
    stacked_experts,
)
from ..format_types import FileWriting, Format
from ..io import Checkpoint, TensorPlan, carry_files
from ..plans import TensorMap, copy_rest

# The added Gated DeltaNet layer: Qwen3.5's head size and convolution, one key head and one value head.
LINEAR_HEAD_DIM = 128
LINEAR_CONV_KERNEL = 4
# llama.cpp's Qwen3.5 applies multi-section RoPE: a text token has the same position in every section, so any
# sections that cover the rotary dimensions give plain RoPE. Qwen3.5's own when they fit (head_dim >= 32), else one
# pair each (a section sum above the rotary dimensions is refused by ggml).
QWEN3_5_ROPE_SECTIONS = [11, 11, 10, 0]

# GatedQwen / Qwen3.5 names of a decoder layer (after `model.layers.N.`) -> llama.cpp's (after `blk.N.`).
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
FILE_TYPES = {"float32": "ALL_F32", "float16": "MOSTLY_F16", "bfloat16": "MOSTLY_BF16"}  # by torch dtype name

# Byte-level BPE pre-tokenizers llama.cpp implements, by the split pattern of tokenizer.json.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
                 r"\s+(?!\S)|\s+")
QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                  r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {QWEN2_PATTERN: "qwen2", QWEN35_PATTERN: "qwen35"}


def _gguf():
    return import_extra("gguf", "--to gguf writes with the gguf package, which is not installed: pip install "
                                "'gated-qwen[gguf]' (or pip install gguf).")


# ------------------------------------------------------------------------------------------------------ the plan
def gguf_name(name: str) -> str:
    """A Qwen3.5 / Qwen3-Next tensor name -> llama.cpp's (`model.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight`)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def check_llama_cpp_can_run(config) -> None:
    """The refusals of llama.cpp's architectures beyond those of the Qwen3.5 / Qwen3-Next export."""
    if config.attention_bias:
        raise ConversionError("this model has attention_bias=True, an o_proj bias, which llama.cpp's Qwen3.5 / "
                              "Qwen3-Next attention does not have; nothing was written.")
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type != "default":
        raise ConversionError(f"rope_parameters has rope_type={rope_type!r}; --to gguf writes the default RoPE only "
                              "(rope_theta), so this model is refused; nothing was written.")
    if isinstance(config, GatedQwenMoeConfig):
        dense = [i for i in range(config.num_hidden_layers) if i not in config.sparse_layers]
        if dense:
            raise ConversionError(f"layers {dense} of this model are dense (mlp_only_layers / decoder_sparse_step); "
                                  "llama.cpp's Qwen3-Next has experts in every layer; nothing was written.")
        if not config.norm_topk_prob:
            raise ConversionError("this model has norm_topk_prob=False; llama.cpp's Qwen3-Next always renormalises "
                                  "the top-k routing weights, so it would compute another model; nothing was written.")


def _experts(plan: dict[str, TensorPlan], layer: int, num_experts: int) -> dict[str, TensorPlan]:
    """The experts of `layer` in `plan` as llama.cpp's stacked `ffn_{gate,up,down}_exps` `[E, out, in]`."""
    stacked = stacked_experts(plan, layer, num_experts)
    return {f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight": tensor for proj, tensor in stacked.items()}


def _zero_layer(config, layer: int) -> dict[str, TensorPlan]:
    """The added Gated DeltaNet layer `layer` (float32; `_typed` gives it the file's types): its output projections
    (`ssm_out`, and the FFN's or experts' down projections) are zero, so it adds exactly 0 to the residual stream;
    the norms are ones, `ssm_a` -1 (`A_log` 0), the rest zero."""
    hidden, d, blk = config.hidden_size, LINEAR_HEAD_DIM, f"blk.{layer}."
    shapes = {"attn_qkv.weight": (3 * d, hidden), "attn_gate.weight": (d, hidden),  # q, k, v of one head each
              "ssm_conv1d.weight": (3 * d, LINEAR_CONV_KERNEL), "ssm_dt.bias": (1,), "ssm_out.weight": (hidden, d)}
    values = {"attn_norm.weight": ((hidden,), 1.0), "post_attention_norm.weight": ((hidden,), 1.0),
              "ssm_norm.weight": ((d,), 1.0), "ssm_a": ((1,), -1.0)}
    if isinstance(config, GatedQwenMoeConfig):
        experts, inner, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
        shapes.update({
            "ssm_ba.weight": (2, hidden), "ffn_gate_inp.weight": (experts, hidden),
            "ffn_gate_exps.weight": (experts, inner, hidden), "ffn_up_exps.weight": (experts, inner, hidden),
            "ffn_down_exps.weight": (experts, hidden, inner), "ffn_gate_inp_shexp.weight": (1, hidden),
            "ffn_gate_shexp.weight": (shared, hidden), "ffn_up_shexp.weight": (shared, hidden),
            "ffn_down_shexp.weight": (hidden, shared)})
    else:
        inner = config.intermediate_size
        shapes.update({"ssm_beta.weight": (1, hidden), "ssm_alpha.weight": (1, hidden),
                       "ffn_gate.weight": (inner, hidden), "ffn_up.weight": (inner, hidden),
                       "ffn_down.weight": (hidden, inner)})
    values.update({name: (shape, 0.0) for name, shape in shapes.items()})
    return {blk + name: TensorPlan(shape, torch.float32, lambda shape=shape, value=value: torch.full(shape, value))
            for name, (shape, value) in values.items()}


def plan_gguf(ckpt: Checkpoint):
    """`(architecture, the gated_qwen config, {gguf tensor name: TensorPlan})`: llama.cpp's tensors in the order
    written, `FLOAT32_SUFFIXES` and 1-D tensors in float32, the others in the source's dtype (float32 for a dtype
    GGUF has no type for). The attention is Qwen3.5's (the G1 gate rows interleaved into `q_proj` per head, zero k/v
    biases where only the gate has one), the norms as GatedQwen stores them (llama.cpp computes `x̂·w`)."""
    config = load_gated_config(ckpt, moe=True)
    check_llama_cpp_can_run(config)
    moe = isinstance(config, GatedQwenMoeConfig)
    if moe:
        check_shared_expert(config)
    check_qwen3_5_attention(config)
    tmap = TensorMap(ckpt)
    qwen3_5_attention(tmap, config, zero_centred=False, biased=("k_proj", "v_proj"))  # attention_bias: refused above
    copy_rest(tmap, config)
    plan = tmap.finish()
    embedding = ckpt.tensors["model.embed_tokens.weight"].dtype
    dtype = embedding if dtype_name(embedding) in FILE_TYPES else torch.float32
    tensors = {}
    for layer in range(config.num_hidden_layers):
        if moe:
            tensors.update(_experts(plan, layer, config.num_experts))
        prefix = f"model.layers.{layer}."
        for name in [n for n in plan if n.startswith(prefix)]:
            tensors[gguf_name(name)] = plan.pop(name)
    tensors.update({gguf_name(name): tensor for name, tensor in plan.items()})
    tensors.update(_zero_layer(config, config.num_hidden_layers))
    tensors = {name: _typed(name, tensor, dtype) for name, tensor in tensors.items()}
    return ("qwen3next" if moe else "qwen35"), config, tensors


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Written in float32 whatever the model's dtype, as llama.cpp's converter writes them (and its quantizer keeps them):
# 1-D tensors, norms, biases, the routers and the convolution.
FLOAT32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def _typed(name: str, plan: TensorPlan, dtype: torch.dtype) -> TensorPlan:
    wide = len(plan.shape) == 1 or name.endswith(FLOAT32_SUFFIXES) or not name.endswith(".weight")
    want = torch.float32 if wide else dtype
    return plan if plan.dtype == want else TensorPlan(plan.shape, want, lambda: plan.make().to(want))


# ------------------------------------------------------------------------------------------------------ metadata
def write_metadata(writer, arch: str, config, layers: int, dtype: torch.dtype, name: str) -> None:
    """llama.cpp's hyperparameters of the gated_qwen `config` (the same as those of the equivalent Qwen3.5 /
    Qwen3-Next config) plus the added layer."""
    gguf = _gguf()
    writer.add_name(name)
    writer.add_file_type(getattr(gguf.LlamaFileType, FILE_TYPES[dtype_name(dtype)]))
    writer.add_block_count(layers + 1)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_ssm_conv_kernel(LINEAR_CONV_KERNEL)
    writer.add_ssm_state_size(LINEAR_HEAD_DIM)
    writer.add_ssm_group_count(1)
    writer.add_ssm_time_step_rank(1)
    writer.add_ssm_inner_size(LINEAR_HEAD_DIM)
    # Which layers are recurrent: only the added one (full_attention_interval cannot say that, so it is not written).
    writer.add_array(f"{arch}.attention.recurrent_layers", [False] * layers + [True])
    if arch == "qwen35":
        fits = sum(QWEN3_5_ROPE_SECTIONS) <= config.head_dim
        writer.add_rope_dimension_sections(QWEN3_5_ROPE_SECTIONS if fits else [1, 1, 1, 0])
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def pre_tokenizer(tokenizer: dict) -> str | None:
    """llama.cpp's name of the byte-level pre-tokenizer of a tokenizer.json, or None when it has none of them."""
    pre = tokenizer.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") == "Sequence" and len(steps) == 2 and steps[0].get("type") == "Split" \
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        return PRE_TOKENIZERS.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def write_vocabulary(writer, src: Path, vocab_size: int) -> bool:
    """SRC's byte-level BPE tokenizer as llama.cpp's `gpt2` vocabulary (tokens padded to `vocab_size` with unused
    ones, merges, special token ids, chat template; the gguf package's `BpeVocab` and `SpecialVocab`), or `no_vocab`
    without a tokenizer.json; returns whether a vocabulary was written."""
    if not (src / "tokenizer.json").exists():
        writer.add_tokenizer_model("no_vocab")
        writer.add_vocab_size(vocab_size)
        return False
    with scratch_folder("vocabulary") as private:  # owned: a killed run's is removed by the next one or --clean
        _copy_tokenizer_files(src, private)
        _add_vocabulary(writer, private, vocab_size)
    return True


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "merges.txt", "vocab.json",
                   "added_tokens.json", "chat_template.json", "chat_template.jinja")


def _copy_tokenizer_files(src: Path, private: Path) -> None:
    """Copies SRC's tokenizer files into `private`, each through the file opened when it was checked as SRC's own
    (`io.carry_files`), so that what the gguf package reads by name is what was checked, whatever SRC's names point
    to meanwhile."""
    checked = {name: io.source_file(src, name, "SRC's tokenizer file")  # only SRC's own files are read
               for name in TOKENIZER_FILES if (src / name).exists() or (src / name).is_symlink()}
    carry_files(checked, private)


def _add_vocabulary(writer, src: Path, vocab_size: int) -> None:
    """`write_vocabulary` from the checked copies in `src`."""
    gguf = _gguf()
    tokenizer = read_json_object(src / "tokenizer.json", "SRC's tokenizer.json", ConversionError)
    pre = pre_tokenizer(tokenizer)
    model = tokenizer.get("model") or {}
    if pre is None or model.get("type") != "BPE" or model.get("byte_fallback") \
            or (tokenizer.get("decoder") or {}).get("type") != "ByteLevel":
        raise ConversionError(
            "SRC's tokenizer.json is not a byte-level BPE tokenizer with GPT-2's, Qwen2's or Qwen3.5's pre-tokenizer, "
            "the ones --to gguf writes (llama.cpp's gpt-2, qwen2, qwen35); convert the folder without its tokenizer "
            "files (a GGUF without vocabulary) or with llama.cpp's convert_hf_to_gguf.py; nothing was written.")
    try:
        vocab = gguf.BpeVocab(src)
    except (FileNotFoundError, ValueError) as error:
        raise ConversionError(f"SRC's tokenizer cannot be written as a GGUF vocabulary: {error}.") from None
    if vocab.vocab_size > vocab_size:
        raise ConversionError(f"SRC's tokenizer has {vocab.vocab_size} tokens, more than the model's vocab_size "
                              f"{vocab_size}; nothing was written.")
    tokens, types = [], []
    for text, _score, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    for i in range(vocab.vocab_size, vocab_size):
        tokens.append(f"[PAD{i}]".encode())
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(src, load_merges=True, n_vocab=vocab_size).add_to_gguf(writer, quiet=True)


# ------------------------------------------------------------------------------------------------------ writing
def write_gguf(path: Path, arch: str, config, tensors: dict[str, TensorPlan], src: Path, name: str) -> bool:
    """Streams the GGUF into `path`: header, metadata and tensor index first, then one tensor at a time (memory:
    about the largest tensor). Returns whether a vocabulary was written."""
    import numpy as np  # the gguf extra's dependency

    gguf = _gguf()
    types = {torch.float32: (None, "float32"), torch.float16: (None, "float16"),
             torch.bfloat16: (gguf.GGMLQuantizationType.BF16, "uint16")}
    dtype = tensors["token_embd.weight"].dtype
    writer = gguf.GGUFWriter(path, arch)
    write_metadata(writer, arch, config, config.num_hidden_layers, dtype, name)
    vocabulary = write_vocabulary(writer, src, config.vocab_size)
    for tensor_name, plan in tensors.items():
        raw, np_dtype = types[plan.dtype]
        writer.add_tensor_info(tensor_name, plan.shape, np.dtype(np_dtype), plan.nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(p.nbytes for p in tensors.values()), unit="B", unit_scale=True,
              desc=f"gated_qwen -> gguf ({arch})") as progress:
        for plan in tensors.values():
            tensor = plan.make().contiguous()
            data = tensor.view(torch.int16).numpy().view(np.uint16) if plan.dtype == torch.bfloat16 else tensor.numpy()
            writer.write_tensor_data(data)
            progress.update(plan.nbytes)
    writer.close()
    return vocabulary


def check_gguf(path: Path, arch: str, tensors: dict[str, TensorPlan]) -> None:
    """The file holds exactly the planned tensors (names, shapes, types), read back with the gguf package."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    found = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    kinds = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    planned = {name: (tuple(plan.shape), kinds[plan.dtype]) for name, plan in tensors.items()}
    field = reader.fields["general.architecture"]
    written_arch = bytes(field.parts[field.data[0]]).decode()
    if found != planned or written_arch != arch:
        wrong = sorted(set(found.items()) ^ set(planned.items()))[:4]
        raise ConversionError(f"the GGUF written does not hold what was planned (architecture {written_arch!r}, "
                              f"differences {wrong}); nothing was written.")


# ------------------------------------------------------------------------------------------------------ --verify
def read_back(path: Path, stock) -> dict[str, torch.Tensor]:
    """The GGUF's tensors as the state dict of the stock Qwen3.5 / Qwen3-Next model `stock` (norms zero-centred
    again); refuses an added layer whose output projections are not all zero."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    data = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:  # read as bytes
            data[t.name] = torch.from_numpy(t.data.copy()).view(torch.bfloat16).reshape(shape)
        else:
            data[t.name] = torch.from_numpy(t.data.copy()).reshape(shape)
    layers = stock.num_hidden_layers
    added = {name: tensor for name, tensor in data.items() if name.startswith(f"blk.{layers}.")}
    outputs = [n for n in added if n.split(".")[2] in ("ssm_out", "ffn_down", "ffn_down_exps", "ffn_down_shexp")]
    if not outputs or any(added[n].view(torch.uint8).any() for n in outputs):
        raise VerificationError(f"the GGUF's added layer {layers} does not add zero (its output projections "
                                f"{outputs} are not all zero). Nothing was written.")
    inverse = {TOP_NAMES[k]: k for k in TOP_NAMES}
    inverse.update({f"blk.{i}.{v}.{kind}": f"model.layers.{i}.{k}.{kind}" for i in range(layers)
                    for k, v in LAYER_NAMES.items() for kind in ("weight", "bias")})
    state = {}
    for name, tensor in data.items():
        if name in added:
            continue
        tensor = tensor.float()
        if name.endswith("_exps.weight"):  # Transformers' in-memory experts: gate_up_proj [E, 2I, H], down_proj
            layer, proj = name.split(".")[1], name.split(".")[2]
            experts = f"model.layers.{layer}.mlp.experts."
            if proj == "ffn_down_exps":
                state[experts + "down_proj"] = tensor
            elif proj == "ffn_gate_exps":
                state[experts + "gate_up_proj"] = torch.cat([tensor, data[name.replace("gate", "up")].float()], 1)
            continue
        hf = inverse[name]
        if name.endswith("norm.weight"):
            tensor = tensor - 1  # Qwen3.5's zero-centred RMSNorm weight
        state[hf] = tensor
    if stock.attention_bias:  # q/k/v biases (a gate bias): the stock attention has an o_proj bias too, 0 here
        for layer in range(layers):
            state[f"model.layers.{layer}.self_attn.o_proj.bias"] = torch.zeros(stock.hidden_size)
    return state


def stock_config(fields: dict, tensors: set[str]):
    """The stock Qwen3.5 text / Qwen3-Next config (every layer full attention) that a GGUF's metadata `fields`
    describe, for its tensor names `tensors` (the added layer left out)."""
    arch = fields["general.architecture"]

    def key(name):
        return fields[f"{arch}.{name}"]

    layers, head_dim = key("block_count") - 1, key("attention.key_length")
    common = dict(
        vocab_size=key("vocab_size") if "tokenizer.ggml.tokens" not in fields else len(fields["tokenizer.ggml.tokens"]),
        hidden_size=key("embedding_length"), intermediate_size=key("feed_forward_length"), num_hidden_layers=layers,
        num_attention_heads=key("attention.head_count"), num_key_value_heads=key("attention.head_count_kv"),
        head_dim=head_dim, max_position_embeddings=key("context_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"), layer_types=["full_attention"] * layers,
        rope_parameters={"rope_type": "default", "rope_theta": key("rope.freq_base"),
                         "partial_rotary_factor": key("rope.dimension_count") / head_dim},
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors)
    if arch == "qwen35":
        return Qwen3_5TextConfig(**common)
    return Qwen3NextConfig(**common, num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                           moe_intermediate_size=key("expert_feed_forward_length"),
                           shared_expert_intermediate_size=key("expert_shared_feed_forward_length"),
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def gguf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """`input_ids: [B, S]` -> float32 logits `[B, S, vocab]` of the GGUF `path` read as what llama.cpp's Qwen3.5 /
    Qwen3-Next compute: its metadata as the stock Transformers config (`stock_config`), its tensors read back into
    `Qwen3_5ForCausalLM` / `Qwen3NextForCausalLM` (`read_back`, which refuses an added layer that is not zero). The
    `--verify` of `--to gguf`; what llama.cpp itself computes from the file is checked by `make test-llama`."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    stock = stock_config({name: field.contents() for name, field in reader.fields.items()},
                         {t.name for t in reader.tensors})
    model = AutoModelForCausalLM.from_config(stock, attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = model.load_state_dict(read_back(path, stock), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if stock.tie_word_embeddings else set()):
        raise VerificationError(f"the GGUF's tensors do not fill {type(model).__name__}: missing {missing[:4]}, "
                                f"unexpected {unexpected[:4]}. Nothing was written.")
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(input_ids).logits.float()


def write(ckpt: Checkpoint, path: Path) -> tuple[int, str]:
    """`gated-qwen convert SRC DST.gguf --to gguf` (`FileWriting.write`): the GGUF of the gated_qwen checkpoint
    `ckpt` written to `path` and read back (exactly the planned tensors); returns its vocabulary size and the line
    that reports it."""
    _gguf()
    arch, config, tensors = plan_gguf(ckpt)
    vocabulary = write_gguf(path, arch, config, tensors, ckpt.folder, ckpt.folder.resolve().name)
    check_gguf(path, arch, tensors)
    words = "" if vocabulary else ("; no tokenizer.json in SRC, so no vocabulary: llama.cpp runs it on token ids, "
                                   "chat front ends need one")
    return config.vocab_size, (f"{arch}: {config.num_hidden_layers} attention layers + 1 zero Gated DeltaNet layer, "
                              f"{len(tensors)} tensors{words}")

GGUF = Format(
    "gguf", "one GGUF file for llama.cpp (Qwen3.5 architecture; Qwen3-Next for the mixture of experts), G1 sigmoid "
    "gates, plus one zero Gated DeltaNet layer llama.cpp needs (docs/local.md)",
    writing=FileWriting(write, gguf_logits))
