"""The gate of Qiu et al. (2025), "Gated Attention for Large Language Models": its variants, its geometry and the
module.

`Y' = combine(Y, act(X W))`, with X the hidden state after the pre-attention RMSNorm (the input of q/k/v). The
paper varies five things, each a config field; this registry lists their values once, for the config (which accepts
exactly these), the model, the conversions, the Hub card and the analysis:

| field                      | values                                                                     |
|----------------------------|----------------------------------------------------------------------------|
| `gate_position`            | `POSITIONS`: "sdpa" (G1) ... "dense" (G5), or None (no gate)                |
| `gate_granularity`         | `GRANULARITIES`: "elementwise" (a score per element), "headwise" (per head) |
| `gate_shared_across_heads` | one set of scores for every head                                            |
| `gate_combine`             | `COMBINES`: "multiply" `Y * s`, "add" `Y + s`                               |
| `gate_activation`          | `ACTIVATIONS`: "sigmoid", "silu", "ns_sigmoid" (`0.5 + 0.5 sigmoid`), ...   |
| `gate_input_dependent`     | False: a learned logit per score instead of `X W` (the paper's control)     |
Without a gate, `sdpa_output_transform` selects one of the paper's non-gate controls on the attention output
(`SDPA_OUTPUT_TRANSFORMS`). A new activation is one entry of `ACTIVATIONS`.

The gate's geometry (`gated_layers`, `gate_shape`, `gate_parameters_per_layer`) is computed here from a config's
fields; the config validates the fields and the rules across them.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.utils import is_torch_distributed_available


@dataclass(frozen=True)
class GatePosition:
    """Where a gate acts. `heads`: the heads of the gated tensor ("query", "key_value", or None for the hidden
    state); `producer`: the projection whose output is gated (for G1, the one whose output the attention mixes)."""

    name: str
    paper: str
    heads: str | None
    producer: str
    description: str


POSITIONS: dict[str, GatePosition] = {
    p.name: p
    for p in (
        GatePosition("sdpa", "G1", "query", "v_proj", "the attention output of each head, before `o_proj`"),
        GatePosition("value", "G2", "key_value", "v_proj", "the output of `v_proj` (the values)"),
        GatePosition("key", "G3", "key_value", "k_proj", "the output of `k_proj` (the keys)"),
        GatePosition("query", "G4", "query", "q_proj", "the output of `q_proj` (the queries)"),
        GatePosition("dense", "G5", None, "o_proj", "the output of `o_proj`"),
    )
}
# The paper's names of the positions (section 2, table 1), accepted wherever a position is.
ALIASES: dict[str, str] = {p.paper: p.name for p in POSITIONS.values()}
GRANULARITIES = ("elementwise", "headwise")
COMBINES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"multiply": torch.mul, "add": torch.add}


def ns_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """The paper's non-sparse sigmoid, `0.5 + 0.5 * sigmoid(x)`, with values in [0.5, 1]."""
    return 0.5 + 0.5 * torch.sigmoid(x)


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": ns_sigmoid,
    "identity": identity,
}
SDPA_OUTPUT_TRANSFORMS = ("rmsnorm", "silu")

# The gate fields besides `gate_position`, with their defaults: the paper's recommended gate.
DEFAULTS = {
    "gate_granularity": "elementwise",
    "gate_shared_across_heads": False,
    "gate_combine": "multiply",
    "gate_activation": "sigmoid",
    "gate_input_dependent": True,
    "gate_bias": False,
    "gate_layers": None,
}
FIELDS = ("gate_position", *DEFAULTS, "sdpa_output_transform")


def canonical_position(position):
    """`position` with the paper's names (G1...G5, any case) replaced by the config's; other values unchanged."""
    if isinstance(position, str) and position.upper() in ALIASES:
        return ALIASES[position.upper()]
    return position


# The name the gated_qwen package registers its fused kernel under (`attn_implementation="gated_triton"`).
FUSED_ATTENTION = "gated_triton"


def applies_output_gate(attention_function) -> bool:
    """Whether an attention function registered with Transformers' `AttentionInterface` applies the G1 sigmoid gate
    in its epilogue, which it says with the attribute `applies_output_gate = True` (the gated_qwen package's fused
    kernel does): the attention module then hands it the gate's logits as `output_gate` instead of multiplying
    afterwards. Every other function is given no gate."""
    return getattr(attention_function, "applies_output_gate", False) is True


def gated_layers(config) -> list[int]:
    """Indices of the layers of `config` that carry a gate (empty without a gate)."""
    if config.gate_position is None:
        return []
    return list(range(config.num_hidden_layers)) if config.gate_layers is None else list(config.gate_layers)


def gate_shape(config) -> tuple[int, int] | None:
    """`(heads, width)` of one token's gate scores in a gated layer of `config`, or None without a gate: G1/G4 act on
    the query heads, G2/G3 on the key/value heads, G5 on the hidden state (one "head"); head-shared gates have one
    head, headwise gates width 1."""
    if config.gate_position is None:
        return None
    heads = POSITIONS[config.gate_position].heads
    if heads is None:
        return 1, config.hidden_size
    heads = 1 if config.gate_shared_across_heads else (
        config.num_attention_heads if heads == "query" else config.num_key_value_heads)
    return heads, config.head_dim if config.gate_granularity == "elementwise" else 1


def gate_parameters_per_layer(config) -> int:
    """Parameters one gated layer of `config` adds: `hidden * heads * width` (+ bias) for an input-dependent gate,
    `heads * width` learned logits otherwise, 0 without a gate."""
    shape = gate_shape(config)
    if shape is None:
        return 0
    scores = shape[0] * shape[1]
    if not config.gate_input_dependent:
        return scores
    return config.hidden_size * scores + (scores if config.gate_bias else 0)


def is_fusable(config) -> bool:
    """Whether a gate with this config's fields is the G1 sigmoid product that an attention function which
    `applies_output_gate` applies in its epilogue."""
    return (config.gate_position == "sdpa" and config.gate_combine == "multiply"
            and config.gate_activation == "sigmoid")


def is_recommended(config) -> bool:
    """Whether this is the paper's recommended gate: G1, elementwise, head-specific, multiplicative sigmoid of X W
    (input-dependent, W bias-free), in whichever layers carry it."""
    return (is_fusable(config) and config.gate_granularity == "elementwise" and not config.gate_shared_across_heads
            and config.gate_input_dependent and not config.gate_bias)


class GatedQwenGate(nn.Module):
    """The gate of one attention layer, or (without a gate) the paper's non-gate control on the attention output.

    Built from the config: `position` (None in an ungated layer), the projection `g_proj` (`[hidden] -> [heads *
    width]`, rows laid out per head; see `gate_shape`) or, for the input-independent control, the
    learned `logits` `[heads, width]` (zero-initialised: sigmoid 0.5), the activation and the combine rule. Its
    tensors are `self_attn.gate.g_proj.*`, `self_attn.gate.logits` and `self_attn.gate.sdpa_norm.*`, on disk and in
    memory.

    The attention module calls `logits = gate(x)` once (`x`: its input, `[B, S, hidden]`) and then
    `y = gate.apply_at(position, y, logits)` at every place a gate can act; `apply_at` changes `y` only at this gate's
    position (not `apply`: that is `nn.Module.apply(fn)`, which DeepSpeed and initialisation code call on every
    module). A backend that fuses the G1 sigmoid product (`fusable`) receives the logits instead. `forward`'s
    output is what `output_gate_logits=True` records; `scores(x) = act(gate(x))` are what the paper measures.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.position = config.gate_position if layer_idx in gated_layers(config) else None
        self.transform = None if self.position is not None else config.sdpa_output_transform
        self.fusable = self.position is not None and is_fusable(config)
        if self.position is not None:
            self.heads, self.width = gate_shape(config)
            if config.gate_input_dependent:
                self.g_proj = nn.Linear(config.hidden_size, self.heads * self.width, bias=config.gate_bias)
            else:
                self.logits = nn.Parameter(torch.zeros(self.heads, self.width))
            self.activation = ACTIVATIONS[config.gate_activation]
            self.combine = COMBINES[config.gate_combine]
        elif self.transform == "rmsnorm":
            self.sdpa_norm = Qwen3RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`hidden_states: [B, S, hidden]` -> the gate logits `[B, S, heads, width]` (`[heads, width]` for the
        input-independent gate), or None without a gate."""
        if self.position is None:
            return None
        if hasattr(self, "g_proj"):
            # -1, not self.heads: under tensor parallelism g_proj holds only this rank's heads.
            return self.g_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.width)
        return self.logits

    def scores(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`act(gate logits)`, shaped as `forward`'s output."""
        logits = self(hidden_states)
        return None if logits is None else self.activation(logits)

    def apply_at(self, position: str, y: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """`y` at `position`: `[B, S, heads_y, head_dim]` for a head position, `[B, S, hidden]` for "dense" ->
        `combine(y, act(logits))` if the gate acts there (the control's transform at "sdpa" without a gate), else
        `y` itself."""
        if position != self.position:
            if position == "sdpa" and self.transform == "silu":
                return F.silu(y)
            if position == "sdpa" and self.transform == "rmsnorm":
                return self.sdpa_norm(y)
            return y
        if logits.dim() == 2 and position != "dense" and logits.shape[0] not in (1, y.shape[-2]):
            raise ValueError(
                f"the input-independent gate holds logits for {logits.shape[0]} heads but this attention computes "
                f"{y.shape[-2]}: tensor parallelism split the heads but not `gate.logits` (vLLM's Transformers "
                "backend shards linear layers only). Serve this model without tensor parallelism or, a G1 sigmoid gate, "
                "as its export (`gated-qwen convert --to qwen3_5`), which vLLM's own Qwen3.5 model shards."
            )
        scores = self.activation(logits).to(y.dtype)
        if position == "dense":
            scores = scores.flatten(-2)  # one "head" as wide as the hidden state
        return self.combine(y, scores)

    def extra_repr(self) -> str:
        if self.position is None:
            return f"position=None, sdpa_output_transform={self.transform!r}"
        return f"position={self.position!r}, heads={self.heads}, width={self.width}, fusable={self.fusable}"


# Tensor parallelism (`tp_plan="auto"`, see `GatedQwenConfig.base_model_tp_plan`) splits the heads across ranks. A
# head-shared gate is whole on every rank, but each rank's heads give only part of the gradient of its scores (and
# through them of the hidden state): the "head_shared_gate" style sums that gradient across ranks in the backward
# pass; the forward pass is unchanged.
HEAD_SHARED_GATE_STYLE = "head_shared_gate"

if is_torch_distributed_available():
    import torch.distributed as dist

    from .transformers_compat import ALL_PARALLEL_STYLES, TensorParallelLayer

    class _SumGradientOverRanks(torch.autograd.Function):
        """Identity forward; the backward all-reduces (sums) the incoming gradient over the process group."""

        @staticmethod
        def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            grad = grad.contiguous()
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
            return grad, None

    class HeadSharedGateParallel(TensorParallelLayer):
        """Replicated gate projection whose output feeds sharded heads: sums the output's gradient over ranks."""

        def transform_output_post_forward(self, module, output, mesh, config=None):  # config: passed by 5.25
            if torch.is_grad_enabled() and output.requires_grad:
                return _SumGradientOverRanks.apply(output, mesh.get_group())
            return output


def register_head_shared_gate_style() -> None:
    """Registers the "head_shared_gate" style with Transformers' tensor parallelism (where torch has distributed
    support; idempotent). A model registers it when it is built, before its plan is checked or applied."""
    if is_torch_distributed_available() and HEAD_SHARED_GATE_STYLE not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(HEAD_SHARED_GATE_STYLE, HeadSharedGateParallel())
