"""CPU speed of GatedQwen against stock Transformers models of the same size: training step and greedy decode.

Each row of the table is a *pair*: an anchor model A (a stock Transformers model, or the no-gate GatedQwen) and a
GatedQwen model B. Where the two compute the same function, A's weights are mapped into B and the script asserts that
their logits agree before timing anything. The two models of a pair are then timed interleaved (A, B, A, B, ...) after
a warm-up, and the table reports the medians and the ratio B/A of the times (above 1: B is slower).

The bar: B/A <= (FLOPs of B / FLOPs of A) + 0.03, for the training step and for decode. FLOPs per token are
counted from the models' `nn.Linear` layers plus the attention products (`flops_per_token`), so for pairs of the same
function the bar is 1.03 and for a gate variant it is 1 + its extra FLOPs + 0.03.

By default the models run on one thread and are timed by this process's CPU time, which other engineers' jobs on a
shared machine barely change (the elapsed time does, by tens of percent); `--clock wall` times elapsed seconds.

    .venv/bin/python benchmarks/model_cpu.py               # default sizes (10-20 minutes on a shared 2-core machine)
    .venv/bin/python benchmarks/model_cpu.py --threads 2 --clock wall   # on a quiet machine
    .venv/bin/python benchmarks/model_cpu.py --quick       # seconds-long smoke run with tiny sizes
    .venv/bin/python benchmarks/model_cpu.py --pairs G1,G2 # only the pairs whose name contains "G1" or "G2"

To add a pair (e.g. another GatedQwen-MoE variant vs Qwen3MoeForCausalLM), append a `Pair` to `PAIRS`: two builders that take the
sizes (`argparse.Namespace`) and return a model, and, if the two compute the same function, a `map_weights` that turns
the anchor's state dict into B's. A model whose FLOPs are not those of its `nn.Linear` layers (experts stored as 3-D
parameters, top-k routing) also gives its own `flops_per_token`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers import (
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM

PAD, EOS = 0, 1
EQUALITY_RTOL, EQUALITY_ATOL = 1e-4, 1e-5  # float32, a few layers: the same function up to summation order


# ------------------------------------------------------------------------------------------------------ model builders
def shared_fields(s: argparse.Namespace) -> dict:
    """The config fields every model of the benchmark shares (all three config classes take them)."""
    return {
        "vocab_size": s.vocab, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": None,
    }


def build(model_class: type, config) -> nn.Module:
    """A float32 model with the sdpa attention backend and a fixed seed."""
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    return model_class(config).float()


def qwen3(s: argparse.Namespace) -> nn.Module:
    return build(Qwen3ForCausalLM, Qwen3Config(**shared_fields(s)))


def qwen3_5(s: argparse.Namespace) -> nn.Module:
    """Text-only Qwen3.5 with every layer full attention and full rotary: its attention is GatedQwen's G1 gate."""
    config = Qwen3_5TextConfig(
        **shared_fields(s), layer_types=["full_attention"] * s.layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    )
    return build(Qwen3_5ForCausalLM, config)


def gated(**gate_fields) -> Callable[[argparse.Namespace], nn.Module]:
    """A builder of GatedQwenForCausalLM with the given gate fields (`gate_position=None`: no gate)."""
    def builder(s: argparse.Namespace) -> nn.Module:
        return build(GatedQwenForCausalLM, GatedQwenConfig(**shared_fields(s), **gate_fields))
    return builder


def moe_fields(s: argparse.Namespace) -> dict:
    """The mixture-of-experts fields of the MoE pairs (Qwen3-MoE's names, shared by the three MoE config classes)."""
    return {"num_experts": s.experts, "num_experts_per_tok": s.experts_per_tok,
            "moe_intermediate_size": s.moe_intermediate, "norm_topk_prob": True}


def qwen3_moe(s: argparse.Namespace) -> nn.Module:
    return build(Qwen3MoeForCausalLM, Qwen3MoeConfig(**shared_fields(s), **moe_fields(s)))


def qwen3_next(s: argparse.Namespace) -> nn.Module:
    """Qwen3-Next with every layer full attention and full rotary: a G1-gated MoE with a shared expert."""
    config = Qwen3NextConfig(
        **shared_fields(s), **moe_fields(s), shared_expert_intermediate_size=s.shared_expert,
        layer_types=["full_attention"] * s.layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    )
    return build(Qwen3NextForCausalLM, config)


def gated_moe(**fields) -> Callable[[argparse.Namespace], nn.Module]:
    """A builder of GatedQwenMoeForCausalLM with the given gate / shared-expert fields."""
    def builder(s: argparse.Namespace) -> nn.Module:
        return build(GatedQwenMoeForCausalLM, GatedQwenMoeConfig(**shared_fields(s), **moe_fields(s), **fields))
    return builder


# ------------------------------------------------------------------------------------------------------ weight mappings
def same_names(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Qwen3 -> no-gate GatedQwen: the parameter names and layouts are the same."""
    return dict(state)


def qwen3_5_to_g1(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Qwen3.5 (all full attention) -> GatedQwen G1 elementwise.

    Qwen3.5's `q_proj` rows are laid out per head as `[q_h | gate_h]` (`[H * 2D, hidden]`): split into `q_proj`
    (`[H * D, hidden]`) and the gate's `gate.g_proj` (`[H * D, hidden]`). Qwen3.5's RMSNorms are zero-centred (`x_hat * (1 + w)`),
    GatedQwen's are not (`x_hat * w`): every norm weight becomes `1 + w`.
    """
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    out = {}
    for name, tensor in state.items():
        if name.endswith("self_attn.q_proj.weight"):
            per_head = tensor.view(heads, 2, head_dim, -1)
            out[name] = per_head[:, 0].reshape(heads * head_dim, -1).clone()
            out[name.replace("q_proj", "gate.g_proj")] = per_head[:, 1].reshape(heads * head_dim, -1).clone()
        elif name.endswith("norm.weight"):
            out[name] = 1.0 + tensor
        else:
            out[name] = tensor
    return out


# ------------------------------------------------------------------------------------------------------------ FLOPs
def flops_per_token(model: nn.Module, context: float) -> float:
    """Forward FLOPs per token: `2 * in * out` for every `nn.Linear` (lm_head included) plus, per layer with
    attention, `4 * heads * head_dim * context` for the two attention products (`context`: positions attended)."""
    linear = sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))
    config = model.config
    attention = 4 * config.num_attention_heads * config.head_dim * context * config.num_hidden_layers
    return linear + attention


def moe_flops_per_token(model: nn.Module, context: float) -> float:
    """`flops_per_token` plus, per sparse layer, the router (`2 * hidden * experts`) and the k routed experts
    (`k * 2 * 3 * hidden * moe_intermediate`): neither is an `nn.Linear`. Shared experts are `nn.Linear`s."""
    config = model.config
    sparse = sum(1 for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate"))
    experts = 3 * config.num_experts_per_tok * config.moe_intermediate_size
    routed = 2 * config.hidden_size * (config.num_experts + experts)
    return flops_per_token(model, context) + sparse * routed


# ------------------------------------------------------------------------------------------------------------ pairs
@dataclass
class Pair:
    """An anchor model A and a GatedQwen model B, timed against each other.

    build_a, build_b: sizes -> model. map_weights: (A's state dict, model B) -> B's state dict, for pairs that compute
    the same function (the script then asserts equal logits); None for pairs that compute different functions.
    """

    name: str
    build_a: Callable[[argparse.Namespace], nn.Module]
    build_b: Callable[[argparse.Namespace], nn.Module]
    map_weights: Callable[[dict, nn.Module], dict] | None = None
    flops_per_token: Callable[[nn.Module, float], float] = flops_per_token


NO_GATE = gated(gate_position=None)
PAIRS: list[Pair] = [
    Pair("no gate vs Qwen3", qwen3, NO_GATE, same_names),
    Pair("G1 elementwise vs Qwen3.5 (full attn)", qwen3_5, gated(), qwen3_5_to_g1),
    Pair("G1 headwise vs Qwen3", qwen3, gated(gate_granularity="headwise")),
    Pair("G1 headwise vs Qwen3.5 (full attn)", qwen3_5, gated(gate_granularity="headwise")),
    Pair("G2 value vs no gate", NO_GATE, gated(gate_position="value")),
    Pair("G3 key vs no gate", NO_GATE, gated(gate_position="key")),
    Pair("G4 query vs no gate", NO_GATE, gated(gate_position="query")),
    Pair("G5 dense vs no gate", NO_GATE, gated(gate_position="dense")),
    Pair("G1 head-shared vs no gate", NO_GATE, gated(gate_shared_across_heads=True)),
    Pair("G1 additive SiLU vs no gate", NO_GATE, gated(gate_combine="add", gate_activation="silu")),
    Pair("G1 NS-sigmoid vs no gate", NO_GATE, gated(gate_activation="ns_sigmoid")),
    Pair("G1 input-independent vs no gate", NO_GATE, gated(gate_input_dependent=False)),
    Pair("SDPA-output RMSNorm vs no gate", NO_GATE, gated(gate_position=None, sdpa_output_transform="rmsnorm")),
    Pair("SDPA-output SiLU vs no gate", NO_GATE, gated(gate_position=None, sdpa_output_transform="silu")),
    Pair("MoE no gate vs Qwen3-MoE", qwen3_moe, gated_moe(gate_position=None), same_names, moe_flops_per_token),
    Pair("MoE G1 + shared expert vs Qwen3-Next (full attn)", qwen3_next,
         lambda s: gated_moe(shared_expert_intermediate_size=s.shared_expert)(s), qwen3_5_to_g1, moe_flops_per_token),
]


# ------------------------------------------------------------------------------------------------------------ checks
def perturb_norms(model: nn.Module, generator: torch.Generator) -> None:
    """Adds noise to every RMSNorm weight, so that a wrong norm mapping shows in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def check_same_logits(a: nn.Module, b: nn.Module, vocab: int) -> float:
    """Asserts that A and B give the same logits on a random batch `[2, 32]`; returns the largest |difference|."""
    ids = torch.randint(2, vocab, (2, 32), generator=torch.Generator().manual_seed(1))
    a.eval(), b.eval()
    with torch.no_grad():
        logits_a, logits_b = a(input_ids=ids).logits, b(input_ids=ids).logits
    torch.testing.assert_close(logits_b, logits_a, rtol=EQUALITY_RTOL, atol=EQUALITY_ATOL,
                               msg=lambda m: f"the pair's models do not compute the same function: {m}")
    return (logits_b - logits_a).abs().max().item()


# ------------------------------------------------------------------------------------------------------------ timing
# "cpu": the CPU time of this process, which other processes' load barely changes (use it with one thread: with
# more, it also counts the threads' spin-waits); "wall": elapsed time, for a quiet machine.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def time_train_step(model: nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                    clock: Callable[[], float]) -> float:
    """Seconds for forward + backward (+ the optimizer step) on `ids: [B, S]` as both input and labels."""
    model.train()
    start = clock()
    model(input_ids=ids, labels=ids).loss.backward()
    if optimizer is not None:
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return clock() - start


def time_decode(model: nn.Module, prompt: torch.Tensor, new_tokens: int, clock: Callable[[], float]) -> float:
    """Seconds for greedy `generate` of exactly `new_tokens` tokens after `prompt: [1, P]` (prefill included)."""
    model.eval()
    start = clock()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD, eos_token_id=EOS)
    seconds = clock() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens, f"decoded {out.shape[1] - prompt.shape[1]} tokens"
    return seconds


def run_pair(pair: Pair, s: argparse.Namespace) -> dict:
    """Builds, checks and times one pair; returns the row of the table as a dict."""
    model_a, model_b = pair.build_a(s), pair.build_b(s)
    max_diff = None
    if pair.map_weights is not None:
        perturb_norms(model_a, torch.Generator().manual_seed(2))
        model_b.load_state_dict(pair.map_weights(model_a.state_dict(), model_b), strict=True)
        max_diff = check_same_logits(model_a, model_b, s.vocab)

    generator = torch.Generator().manual_seed(3)
    train_ids = torch.randint(2, s.vocab, (s.batch, s.seq), generator=generator)
    prompt = torch.randint(2, s.vocab, (1, s.prompt), generator=generator)
    optimizers = {m: torch.optim.AdamW(m.parameters(), lr=1e-5) if s.optimizer else None for m in (model_a, model_b)}

    clock = CLOCKS[s.clock]
    times = {(m, kind): [] for m in (model_a, model_b) for kind in ("train", "decode")}
    for rep in range(s.warmup + s.reps):
        for m in (model_a, model_b):
            seconds = time_train_step(m, train_ids, optimizers[m], clock)
            if rep >= s.warmup:
                times[m, "train"].append(seconds)
        for m in (model_a, model_b):
            seconds = time_decode(m, prompt, s.new_tokens, clock)
            if rep >= s.warmup:
                times[m, "decode"].append(seconds)

    train_context, decode_context = (s.seq + 1) / 2, s.prompt + (s.new_tokens + 1) / 2
    row = {"pair": pair.name, "max_diff": max_diff}
    for kind, context in (("train", train_context), ("decode", decode_context)):
        median_a, median_b = statistics.median(times[model_a, kind]), statistics.median(times[model_b, kind])
        flops_a, flops_b = pair.flops_per_token(model_a, context), pair.flops_per_token(model_b, context)
        per_rep = [b / a for a, b in zip(times[model_a, kind], times[model_b, kind])]  # A and B ran side by side
        row[kind] = {"a": median_a, "b": median_b, "ratio": median_b / median_a, "range": (min(per_rep), max(per_rep)),
                     "extra_flops": flops_b / flops_a - 1, "bar": flops_b / flops_a + 0.03}
        row[kind]["ok"] = row[kind]["ratio"] <= row[kind]["bar"]
    return row


# ------------------------------------------------------------------------------------------------------------ report
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} logical cores)"
    except (OSError, IndexError):
        return f"{platform.processor() or platform.machine()} (cpuinfo unavailable)"


def markdown(rows: list[dict], s: argparse.Namespace) -> str:
    lines = [
        *(["- `--quick`: a smoke run with tiny sizes and one repetition; its timings mean nothing"] if s.quick else []),
        (f"- machine: {cpu_model()}; torch {torch.__version__} with `torch.get_num_threads()` = "
         f"{torch.get_num_threads()}; transformers {transformers.__version__}; float32, sdpa attention; "
         f"clock: {'process CPU time' if s.clock == 'cpu' else 'wall time'}"),
        (f"- sizes: hidden {s.hidden}, {s.layers} layers, {s.heads} q / {s.kv_heads} kv heads, "
         f"head_dim {s.head_dim}, intermediate {s.intermediate}, vocab {s.vocab}, untied lm_head; MoE pairs: "
         f"{s.experts} experts of width {s.moe_intermediate}, top-{s.experts_per_tok} (normalised), shared expert "
         f"{s.shared_expert} (Qwen3-Next pair), Transformers' default experts implementation (grouped_mm)"),
        (f"- training step: forward + backward{' + AdamW step' if s.optimizer else ''} on {s.batch}x{s.seq} "
         f"tokens; decode: greedy `generate` of {s.new_tokens} tokens after a {s.prompt}-token prompt, batch 1, "
         f"prefill included; medians of {s.reps} interleaved repetitions after {s.warmup} warm-up"),
        ("- ratio = median time B / median time A (above 1: B slower), in brackets the lowest and highest B/A of one "
         "repetition; bar = FLOPs B / FLOPs A + 0.03; "
         "extra FLOPs = forward FLOPs per token of B over A (matmuls and attention products)"),
        "",
        ("| pair (B vs A) | same logits (max abs diff) | train A s | train B s | train B/A | train bar | "
         "decode A tok/s | decode B tok/s | decode B/A | decode bar | extra FLOPs train / decode |"),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = "n/a (different functions)" if r["max_diff"] is None else f"yes ({r['max_diff']:.1e})"
        t, d = r["train"], r["decode"]
        lines.append(
            f"| {r['pair']} | {same} | {t['a']:.3f} | {t['b']:.3f} | {t['ratio']:.3f}{'' if t['ok'] else ' ✗'} "
            f"[{t['range'][0]:.2f}, {t['range'][1]:.2f}] | "
            f"{t['bar']:.3f} | {s.new_tokens / d['a']:.1f} | {s.new_tokens / d['b']:.1f} | "
            f"{d['ratio']:.3f}{'' if d['ok'] else ' ✗'} [{d['range'][0]:.2f}, {d['range'][1]:.2f}] | "
            f"{d['bar']:.3f} | "
            f"{100 * t['extra_flops']:+.2f}% / {100 * d['extra_flops']:+.2f}% |"
        )
    lines.append("")
    lines.append("✗: the ratio misses the bar.")
    return "\n".join(lines)


QUICK = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 16, "intermediate": 128, "vocab": 256,
         "batch": 2, "seq": 16, "prompt": 8, "new_tokens": 4, "reps": 1, "warmup": 0,
         "experts": 4, "experts_per_tok": 2, "moe_intermediate": 32, "shared_expert": 32}


def selected(pair: Pair, s: argparse.Namespace) -> bool:
    return any(text in pair.name for text in s.pairs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--experts", type=int, default=16, help="MoE pairs: routed experts per layer")
    p.add_argument("--experts-per-tok", type=int, default=4, help="MoE pairs: top-k")
    p.add_argument("--moe-intermediate", type=int, default=384, help="MoE pairs: width of each expert")
    p.add_argument("--shared-expert", type=int, default=384, help="Qwen3-Next pair: width of the shared expert")
    p.add_argument("--batch", type=int, default=4, help="training batch size")
    p.add_argument("--seq", type=int, default=256, help="training sequence length")
    p.add_argument("--prompt", type=int, default=128, help="decode prompt length")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per generate call")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per model (interleaved A, B, A, B, ...)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions first")
    p.add_argument("--optimizer", action="store_true", help="include an AdamW step in the training step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (torch.set_num_threads)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                   help="cpu: this process's CPU time (steady on a shared machine, meant for --threads 1); "
                        "wall: elapsed time (for a quiet machine)")
    p.add_argument("--pairs", default="", help="run only the pairs whose name contains one of these "
                   "comma-separated texts")
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repetition: a seconds-long smoke run")
    s = p.parse_args(argv)
    if s.quick:
        for key, value in QUICK.items():
            setattr(s, key, value)
    for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "batch", "seq",
                "prompt", "new_tokens", "reps", "threads", "experts", "experts_per_tok", "moe_intermediate",
                "shared_expert"):
        if getattr(s, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be a positive integer, got {getattr(s, key)}")
    if s.warmup < 0:
        p.error(f"--warmup must be 0 or more, got {s.warmup}")
    if s.vocab <= 2:
        p.error(f"--vocab must be above 2 (ids 0 and 1 are pad and eos), got {s.vocab}")
    s.pairs = [text for text in s.pairs.split(",") if text] or [""]
    if not [pair for pair in PAIRS if selected(pair, s)]:
        p.error(f"--pairs {s.pairs!r} matches no pair; the pairs are: {[pair.name for pair in PAIRS]}")
    return s


def main(argv: list[str] | None = None) -> list[dict]:
    """Runs the benchmark, prints the markdown table and returns its rows."""
    s = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(s.threads)
    try:
        rows = []
        for pair in PAIRS:
            if selected(pair, s):
                rows.append(run_pair(pair, s))
                print(f"done: {pair.name}", file=sys.stderr, flush=True)
        print(markdown(rows, s))
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":
    main()
