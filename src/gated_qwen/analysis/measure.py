"""What the paper measures (Qiu et al. 2025, section 4.3 and table 4), on any GatedQwen model:

- F-Attn: the attention probability each query puts on the first token, per layer and head, computed from the
  queries and keys without the sequence x sequence attention map: `p(key 0) = exp(score_0 - logsumexp(scores))`,
  which a fused SDPA kernel returns for a one-hot value, in memory linear in the sequence length;
- M-Act: the maximum |hidden state| output by each decoder layer, and where it occurs;
- mean |SDPA output| per layer before the gate and after it (what enters `o_proj`);
- gate statistics per layer and head: mean score, histogram, share of scores below 0.1 and 0.5
(perplexity against context length, with and without YaRN, and recall accuracy: `perplexity`).

Where the numbers come from, all through public interfaces: the gate logits of every layer from the model's own
output capturing (`output_gate_logits=True`); the queries, keys and output of every attention call from a capturing
attention function (`CAPTURE_ATTENTION`, registered with Transformers' `AttentionInterface`), which computes
exactly what SDPA computes and hands them to the analysis running in this context (a backend that fuses the gate
into attention would return the gated output instead, so the analysis always switches to it and restores the
model's own after); what `o_proj` receives and what each decoder layer returns from PyTorch forward hooks.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CAPTURE_ATTENTION = "gated_qwen_capture"
GATE_BINS = 20  # gate score histograms: 20 equal bins over [0, 1]; scores outside [0, 1] fall into the end bins


_ACTIVE_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("gated_qwen_analysis",
                                                                                      default=None)


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA (`query: [B, Hq, S, D]`, `key, value: [B, Hkv, S, D]` -> `([B, S, Hq, D], None)`) that also hands
    the query, key and output to the analysis running in this context, if any."""
    output, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    recorder = _ACTIVE_RECORDER.get()
    if recorder is not None:
        recorder.attention(module, query, key, output)
    return output, weights


AttentionInterface.register(CAPTURE_ATTENTION, _capture_attention)
AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)  # without it a custom backend gets no mask at all


# --------------------------------------------------------------------------------------------- attention maths
def first_token_attention(
    query: torch.Tensor, key: torch.Tensor, scaling: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Attention probability on key 0 for every query row, without the full attention map.

    `query: [B, Hq, S, D]`, `key: [B, Hkv, S, D]` (after RoPE; `Hkv` divides `Hq`, GQA not expanded) -> `[B, Hq, S]`
    in float32 (float64 for float64 inputs), for causal self-attention over one unpadded sequence per batch row.

    `p(key 0) = exp(score_0 - logsumexp(scores))` is what attention returns for a value that is 1 at key 0 and 0
    elsewhere, so the fused SDPA kernel computes it with its running logsumexp, in memory linear in S (the value is
    as wide as the keys: CPU's fused kernel needs that). A sliding window w changes nothing for rows i < w (they see
    keys 0..i either way); later rows no longer see key 0.
    """
    dtype = torch.promote_types(query.dtype, torch.float32)
    length = query.shape[2] if sliding_window is None else min(query.shape[2], sliding_window)
    one_hot = torch.zeros(*key.shape[:2], length, key.shape[3], dtype=dtype, device=key.device)
    one_hot[:, :, 0] = 1.0
    p0 = torch.zeros(query.shape[:3], dtype=dtype, device=query.device)
    p0[:, :, :length] = F.scaled_dot_product_attention(
        query[:, :, :length].to(dtype), key[:, :, :length].to(dtype), one_hot, is_causal=True, scale=scaling,
        enable_gqa=True,
    )[..., 0]
    return p0


def attention_map(
    query: torch.Tensor, key: torch.Tensor, scaling: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Full causal attention probabilities of a short prefix: `query: [B, Hq, n, D]`, `key: [B, Hkv, n, D]` ->
    `[B, Hq, n, n]` in float32 or wider (row i: query i's distribution over keys 0..n-1)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    k = key.to(dtype).repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.matmul(query.to(dtype), k.transpose(-1, -2)) * scaling
    rows = torch.arange(query.shape[2], device=query.device)[:, None]
    visible = rows >= rows.T  # key j visible from query i when j <= i ...
    if sliding_window is not None:
        visible &= rows.T > rows - sliding_window  # ... and, with a window w, j > i - w (as Transformers masks)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1)


# ------------------------------------------------------------------------------------------------- the recorder
class _Recorder:
    """Accumulates every statistic over the batches of one analysis, in float64 on the CPU (the model may be on
    an accelerator); hooks call it layer by layer."""

    def __init__(self, model, length: int, map_tokens: int, map_layers: list[int], progress: tqdm | None):
        self.config = config = model.config
        layers = config.num_hidden_layers
        self.map_tokens, self.map_layers, self.progress = map_tokens, set(map_layers), progress
        self.p0_sum = torch.zeros(layers, config.num_attention_heads, dtype=torch.float64)
        self.p0_rows = torch.zeros(layers, dtype=torch.float64)
        self.p0_by_position = torch.zeros(layers, length, dtype=torch.float64)  # summed over sequences, head mean
        self.max_act = torch.zeros(layers, dtype=torch.float64)
        self.max_act_position = torch.zeros(layers, dtype=torch.long)
        self.first_token_act = torch.zeros(layers, dtype=torch.float64)  # largest |hidden state| at position 0
        self.other_act = torch.zeros(layers, dtype=torch.float64)  # ... at positions 1..S-1
        self.sdpa_sum = torch.zeros(layers, dtype=torch.float64)
        self.gated_sum = torch.zeros(layers, dtype=torch.float64)
        self.elements = torch.zeros(layers, dtype=torch.float64)
        self.maps: dict[int, torch.Tensor] = {}
        self.sequences = 0
        self.gates: dict[int, dict[str, torch.Tensor]] = {}

    # -- attention function: F-Attn, attention maps, |SDPA output| before the gate
    def attention(self, module, query: torch.Tensor, key: torch.Tensor, output: torch.Tensor) -> None:
        """`query: [B, Hq, S, D]`, `key: [B, Hkv, S, D]`, `output: [B, S, Hq, D]` of layer `module.layer_idx`."""
        layer, window = module.layer_idx, module.sliding_window
        p0 = first_token_attention(query, key, module.scaling, window)  # [B, Hq, S]
        self.p0_sum[layer] += p0[:, :, 1:].sum(dim=(0, 2), dtype=torch.float64).cpu()  # query 0 sees only itself
        self.p0_rows[layer] += p0.shape[0] * (p0.shape[2] - 1)
        self.p0_by_position[layer] += p0.mean(1).sum(0, dtype=torch.float64).cpu()
        self.sdpa_sum[layer] += output.abs().sum(dtype=torch.float64).item()
        self.elements[layer] += output.numel()
        if layer in self.map_layers:
            n = min(self.map_tokens, query.shape[2])
            maps = attention_map(query[:, :, :n], key[:, :, :n], module.scaling, window).sum(0).double().cpu()
            self.maps[layer] = self.maps.get(layer, 0) + maps
        if self.progress is not None:
            self.progress.update(1)

    # -- forward pre-hook on o_proj: |SDPA output| after the gate (what o_proj receives)
    def o_proj_input(self, layer: int, args) -> None:
        self.gated_sum[layer] += args[0].abs().sum(dtype=torch.float64).item()

    # -- the model's `gate_logits` output: the gate scores of one layer
    def gate_logits(self, layer: int, gate, logits: torch.Tensor, tokens: tuple[int, int]) -> None:
        """`logits`: layer `layer`'s gate logits (`[B, S, heads, width]`, or `[heads, width]` for the
        input-independent gate, broadcast over the `tokens` = (B, S)); `gate`: its `GatedQwenGate`."""
        heads, width = gate.heads, gate.width
        scores = gate.activation(logits.double()).expand(*tokens, heads, width).movedim(-2, 0).reshape(heads, -1)
        stats = self.gates.setdefault(layer, {
            "sum": torch.zeros(heads, dtype=torch.float64), "count": torch.zeros((), dtype=torch.float64),
            "below_0.1": torch.zeros(heads, dtype=torch.float64), "below_0.5": torch.zeros(heads, dtype=torch.float64),
            "histogram": torch.zeros(heads, GATE_BINS, dtype=torch.float64),
        })
        stats["sum"] += scores.sum(-1).cpu()
        stats["count"] += scores.shape[1]
        stats["below_0.1"] += (scores < 0.1).sum(-1).cpu()
        stats["below_0.5"] += (scores < 0.5).sum(-1).cpu()
        for head in range(heads):
            stats["histogram"][head] += torch.histc(scores[head].clamp(0, 1), bins=GATE_BINS, min=0, max=1).cpu()

    # -- forward hook on a decoder layer: M-Act
    def layer_output(self, layer: int, output: torch.Tensor) -> None:
        """`output: [B, S, hidden]`, the hidden state a decoder layer returns."""
        peak = output.abs().amax(dim=(0, 2)).double().cpu()  # [S]
        value, position = peak.max(0)
        if value.item() > self.max_act[layer]:
            self.max_act[layer], self.max_act_position[layer] = value.item(), position.item()
        self.first_token_act[layer] = max(self.first_token_act[layer], peak[0])
        self.other_act[layer] = max(self.other_act[layer], peak[1:].max())

    def result(self) -> dict:
        """The statistics as plain Python numbers (JSON-ready), plus the attention maps as tensors."""
        config = self.config
        p0 = self.p0_sum / self.p0_rows.clamp(min=1)[:, None]
        sdpa = self.sdpa_sum / self.elements.clamp(min=1)
        gated = self.gated_sum / self.elements.clamp(min=1)
        layers = []
        for layer in range(config.num_hidden_layers):
            entry = {
                "layer": layer,
                "first_token_attention": p0[layer].mean().item(),
                "first_token_attention_per_head": p0[layer].tolist(),
                "max_activation": self.max_act[layer].item(),
                "max_activation_position": int(self.max_act_position[layer]),
                "first_token_max_activation": self.first_token_act[layer].item(),
                "other_max_activation": self.other_act[layer].item(),
                "sdpa_output_mean_abs": sdpa[layer].item(),
                "gated_output_mean_abs": gated[layer].item(),
                "gate": None,
            }
            if layer in self.gates:
                stats = self.gates[layer]
                count = stats["count"].item()
                entry["gate"] = {
                    "mean": (stats["sum"].sum() / (count * len(stats["sum"]))).item(),
                    "mean_per_head": (stats["sum"] / count).tolist(),
                    "below_0.1": (stats["below_0.1"].sum() / (count * len(stats["sum"]))).item(),
                    "below_0.5": (stats["below_0.5"].sum() / (count * len(stats["sum"]))).item(),
                    "below_0.1_per_head": (stats["below_0.1"] / count).tolist(),
                    "below_0.5_per_head": (stats["below_0.5"] / count).tolist(),
                    "histogram_per_head": (stats["histogram"] / count).tolist(),
                }
            layers.append(entry)
        gated_layers = [e["gate"] for e in layers if e["gate"] is not None]
        summary = {
            "first_token_attention": p0.mean().item(),
            "max_activation": self.max_act.max().item(),
            "mean_max_activation": self.max_act.mean().item(),
            # the paper's massive activation: at the first token, in the residual stream that later layers read
            "first_token_max_activation_nonfinal": (self.first_token_act[:-1].max().item()
                                                    if config.num_hidden_layers > 1 else None),
            "other_max_activation_nonfinal": (self.other_act[:-1].max().item()
                                              if config.num_hidden_layers > 1 else None),
            "sdpa_output_mean_abs": sdpa.mean().item(),
            "gated_output_mean_abs": gated.mean().item(),
            "gate_mean": sum(g["mean"] for g in gated_layers) / len(gated_layers) if gated_layers else None,
            "gate_below_0.1": sum(g["below_0.1"] for g in gated_layers) / len(gated_layers) if gated_layers else None,
            "gate_below_0.5": sum(g["below_0.5"] for g in gated_layers) / len(gated_layers) if gated_layers else None,
        }
        maps = {layer: m / self.sequences for layer, m in sorted(self.maps.items())}
        return {"summary": summary, "layers": layers, "gate_histogram_edges": torch.linspace(0, 1, GATE_BINS + 1)
                .tolist(), "attention_maps": maps, "first_token_attention_by_position":
                self.p0_by_position / self.sequences}


def _decoder(model):
    """The `GatedQwenModel` inside a causal-LM (or other head) model, or the model itself."""
    return model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model


@contextlib.contextmanager
def _capturing(model, recorder: _Recorder):
    """Runs `model` with the capturing attention function, this recorder active and its forward hooks on `o_proj`
    and the decoder layers; restores the model's attention implementation and removes the hooks on exit."""
    decoder = _decoder(model)
    previous = model.config._attn_implementation
    handles = []
    token = _ACTIVE_RECORDER.set(recorder)
    model.set_attn_implementation(CAPTURE_ATTENTION)
    try:
        for i, layer in enumerate(decoder.layers):
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(
                lambda module, args, i=i: recorder.o_proj_input(i, args)))
            handles.append(layer.register_forward_hook(
                lambda module, args, output, i=i: recorder.layer_output(i, output)))
        yield
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
        _ACTIVE_RECORDER.reset(token)


@torch.no_grad()
def analyze(
    model,
    input_ids: torch.Tensor,
    *,
    batch_size: int = 1,
    map_tokens: int = 32,
    map_layers: list[int] | None = None,
    progress: bool = False,
) -> dict:
    """F-Attn, M-Act, mean |SDPA output| before and after the gate, and gate statistics of `model` on `input_ids`.

    `input_ids: [N, S]`: N unpadded sequences of equal length (each should start the way training sequences did,
    e.g. with BOS), run `batch_size` at a time. `map_layers` (default: every layer) get the full attention map of
    the first `map_tokens` tokens, averaged over the sequences. Returns a dict: `summary` (averages over layers and
    heads: `first_token_attention`, `max_activation` (the largest of the per-layer maxima), `mean_max_activation`,
    `sdpa_output_mean_abs`, `gated_output_mean_abs`, `gate_mean`, `gate_below_0.1`, `gate_below_0.5`), `layers`
    (the same per layer, with per-head lists and gate histograms over `gate_histogram_edges`),
    `attention_maps` (`{layer: [Hq, n, n] tensor}`) and `first_token_attention_by_position` (`[layers, S]` tensor,
    averaged over heads and sequences). F-Attn averages over query positions 1..S-1: position 0 can only attend to
    itself.
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"`input_ids` must be [sequences, length] with length >= 2, got shape {tuple(input_ids.shape)}.")
    config = model.config
    if int(input_ids.max()) >= config.vocab_size or int(input_ids.min()) < 0:
        raise ValueError(
            f"`input_ids` holds ids in [{int(input_ids.min())}, {int(input_ids.max())}], outside the model's "
            f"vocabulary [0, {config.vocab_size})."
        )
    if map_layers is None:
        map_layers = list(range(config.num_hidden_layers))
    bad = [i for i in map_layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"`map_layers` {bad} out of range: the model has {config.num_hidden_layers} layers.")
    device = next(model.parameters()).device
    batches = input_ids.split(batch_size)
    bar = tqdm(total=len(batches) * config.num_hidden_layers, desc="analyze", unit="layer") if progress else None
    recorder = _Recorder(model, input_ids.shape[1], map_tokens, map_layers, bar)
    was_training = model.training
    model.eval()
    try:
        decoder = _decoder(model)
        with _capturing(model, recorder):
            for batch in batches:
                out = decoder(input_ids=batch.to(device), use_cache=False, output_gate_logits=True)
                for layer, logits in enumerate(out.gate_logits):
                    if logits is not None:
                        recorder.gate_logits(layer, decoder.layers[layer].self_attn.gate, logits, tuple(batch.shape))
                recorder.sequences += batch.shape[0]
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()
    return recorder.result()


@torch.no_grad()
def first_token_attention_per_query(model, input_ids: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The attention probability on the first token of every query, head and layer, per sequence (not averaged):
    for splitting F-Attn by what the query token is (e.g. the trigger and other positions of the demo's corpus).

    `input_ids: [N, S]` unpadded sequences -> `[N, layers, Hq, S]` float32 (query 0 always 1). Computed as
    `analyze` computes F-Attn (`first_token_attention`, linear memory), under the same capturing attention
    function, restored afterwards.
    """
    config = model.config
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"`input_ids` must be [sequences, length] with length >= 2, got shape {tuple(input_ids.shape)}.")
    rows: dict[int, list[torch.Tensor]] = {}

    class PerQuery:  # the recorder interface `_capture_attention` calls
        @staticmethod
        def attention(module, query, key, output):
            p0 = first_token_attention(query, key, module.scaling, module.sliding_window)  # [B, Hq, S]
            rows.setdefault(module.layer_idx, []).append(p0.float().cpu())

    decoder = _decoder(model)
    previous, was_training = config._attn_implementation, model.training
    device = next(model.parameters()).device
    token = _ACTIVE_RECORDER.set(PerQuery())
    model.set_attn_implementation(CAPTURE_ATTENTION)
    model.eval()
    try:
        for batch in input_ids.split(batch_size):
            decoder(input_ids=batch.to(device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
        model.train(was_training)
        _ACTIVE_RECORDER.reset(token)
    return torch.stack([torch.cat(rows[layer]) for layer in range(config.num_hidden_layers)], dim=1)
