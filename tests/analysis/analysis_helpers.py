"""What the analysis tests hold the measurements against, written out by hand: tiny float64 models with random
weights, every layer's eager attention probabilities and outputs, RMSNorm, fake quantization and the NLL, each layer's
output through hooks, and recall counted position by position."""

import torch

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.analysis.miniature.corpora import KeyValueRecall
from tests.helpers import TINY, randomize_, sizes

VOCAB = 61


def model_for(seed=0, gate_scale=1.0, **overrides) -> GatedQwenForCausalLM:
    """A tiny float64 model with random weights (norms included); `gate_scale` widens the gate logits so that
    scores spread over (0, 1)."""
    fields = sizes(TINY, vocab_size=VOCAB, intermediate_size=48, max_position_embeddings=64,
                   **{"num_hidden_layers": 3, **overrides})
    torch.manual_seed(seed)
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**fields)), seed).double().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate.g_proj" in name or "gate.logits" in name:
                param.mul_(gate_scale)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.mul_(2.5)  # sharper attention than random weights give
    return model


def ids(batch=3, length=19, seed=1) -> torch.Tensor:
    x = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    x[:, 0] = 0
    return x


def eager_outputs(model, input_ids):
    """The attention weights `[B, Hq, S, S]` of every layer (eager attention, which takes its softmax in float32
    even in a float64 model: comparisons with them use float32 tolerances), and every layer's output before the
    final norm (from the model's own SDPA run, float64)."""
    with torch.no_grad():
        model.config.tie_last_hidden_states = False  # keep the last layer's output, not the normed one
        hidden = model(input_ids, output_hidden_states=True).hidden_states
        del model.config.tie_last_hidden_states
        model.set_attn_implementation("eager")
        attentions = model(input_ids, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
    return attentions, hidden


def rms_norm(x, weight, eps):
    """By hand, in float64; the model's RMSNorm (like Qwen3's) normalises in float32, so results built on it agree
    to float32 precision."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "self_attn.gate.g_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def quantize_by_hand(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    """Symmetric round-to-nearest of `x` split into `groups` equal rows, each with the scale max|row| / (2^(bits-1)
    - 1) (kept in float32, as a kernel stores it): s * clamp(round(x / s), -2^(bits-1), 2^(bits-1) - 1); a row of
    zeros stays zero. Computed in float32 or wider, returned in `x`'s dtype."""
    levels = 2 ** (bits - 1) - 1
    rows = x.reshape(groups, -1).to(torch.promote_types(x.dtype, torch.float32))
    scale = (rows.abs().amax(dim=1, keepdim=True).float() / levels).to(rows.dtype)
    steps = torch.where(scale > 0, rows * (1 / scale), torch.zeros_like(rows))  # x / s as x * (1 / s), as kernels do
    return (torch.clamp(torch.round(steps), -levels - 1, levels) * scale).to(x.dtype).view_as(x)


def hand_quantized(model, scheme):
    """A copy of `model` with the weight of every linear layer named in `DECODER_LINEARS` quantized by hand per
    output channel and its input per token or per sequence (forward pre-hooks)."""
    import copy

    model = copy.deepcopy(model)

    def quantize_input(module, args):
        x = args[0]
        groups = x.shape[:-1].numel() if scheme.activation_scale == "token" else x.shape[0]
        return (quantize_by_hand(x, scheme.activation_bits, groups),)

    for layer in model.model.layers:
        for name in DECODER_LINEARS:
            if name == "self_attn.gate.g_proj" and not hasattr(layer.self_attn.gate, "g_proj"):
                continue  # no gate (the baseline)
            linear = layer.get_submodule(name)
            with torch.no_grad():
                linear.weight.copy_(quantize_by_hand(linear.weight, scheme.weight_bits, linear.weight.shape[0]))
            linear.register_forward_pre_hook(quantize_input)
    return model


def nll_by_hand(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logp = model(ids).logits.log_softmax(-1)
    return -logp[:, :-1].gather(-1, ids[:, 1:, None]).mean().item()


def layer_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """What each decoder layer of `model` returns for `ids`, through forward hooks."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, output: outputs.append(
        output[0] if isinstance(output, tuple) else output)) for layer in model.model.layers]
    with torch.no_grad():
        model.eval()(ids)
    for hook in hooks:
        hook.remove()
    return outputs


def count_recall(model, docs: torch.Tensor, corpus: KeyValueRecall) -> tuple[int, float, int]:
    """Hits, summed NLL and number of the positions right after a key token, counted one by one."""
    with torch.no_grad():
        logp = model(docs).logits.log_softmax(-1)
    hits, nll, count = 0, 0.0, 0
    for n, doc in enumerate(docs.tolist()):
        for i in range(1, len(doc)):
            if corpus.fillers < doc[i - 1] <= corpus.fillers + corpus.keys:
                hits += int(logp[n, i - 1].argmax()) == doc[i]
                nll -= logp[n, i - 1, doc[i]].item()
                count += 1
    return hits, nll, count
