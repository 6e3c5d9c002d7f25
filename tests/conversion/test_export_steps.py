"""Each step of `conversion/export_steps.py` alone against the same layout written out by hand on a tiny model's
tensors (read from the saved file with safetensors, not through the code under test): the gate rows interleaved into
`q_proj` per head (Qwen3.5) and per kv group (the release), a constant gate as zero rows and a scaled `o_proj`, the
zero biases, the norms zero-centred or kept, the experts stacked from either on-disk layout. What the exports compute
as a whole is held against stock Transformers classes in each format's tests."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.conversion import export_steps as steps
from gated_qwen.conversion.io import Checkpoint, TensorPlan
from gated_qwen.conversion.plans import TensorMap, copy_rest
from tests.helpers import TINY, randomize_, sizes

H, K, D = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]
G = H // K  # query heads per kv head


def saved(folder, dtype=torch.float32, **fields):
    """A tiny GatedQwen folder: its steps' inputs (a TensorMap of it, its config) and its tensors read by hand."""
    model = randomize_(GatedQwenForCausalLM(GatedQwenConfig(**sizes(TINY, **fields)))).to(dtype)
    model.save_pretrained(folder)
    ckpt = Checkpoint(folder)
    return TensorMap(ckpt), steps.load_gated_config(ckpt), load_file(folder / "model.safetensors")


def written(tmap: TensorMap, config) -> dict[str, torch.Tensor]:
    """What the steps put, with the rest passed through, as the export writes it (the map's public face only)."""
    copy_rest(tmap, config)
    return {name: plan.make() for name, plan in tmap.finish().items()}


def test_interleave_rows_puts_each_groups_gate_rows_after_its_queries():
    queries, gates = torch.randn(H * D, 5), torch.randn(H * D, 5)
    per_head = torch.cat([torch.cat([queries[h * D:(h + 1) * D], gates[h * D:(h + 1) * D]]) for h in range(H)])
    assert torch.equal(steps.interleave_rows(queries, gates, groups=H), per_head)
    scores = torch.randn(H)  # one gate row a head (headwise), grouped per kv head: the release's layout
    per_group = torch.cat([torch.cat([queries[k * G * D:(k + 1) * G * D], scores[k * G:(k + 1) * G, None].expand(G, 5)])
                           for k in range(K)])
    assert torch.equal(steps.interleave_rows(queries, scores[:, None].expand(H, 5), groups=K), per_group)


def test_gate_rows_go_into_q_proj_per_head_with_their_bias(tmp_path):
    tmap, config, w = saved(tmp_path / "g", gate_bias=True)
    steps.gate_rows_into_q_proj(tmap, config, 1, width=D, groups=H, bias=True)
    out = written(tmap, config)
    attn = "model.layers.1.self_attn."
    q, g, gb = w[attn + "q_proj.weight"], w[attn + "gate.g_proj.weight"], w[attn + "gate.g_proj.bias"]
    assert torch.equal(out[attn + "q_proj.weight"],
                       torch.cat([torch.cat([q[h * D:(h + 1) * D], g[h * D:(h + 1) * D]]) for h in range(H)]))
    assert torch.equal(out[attn + "q_proj.bias"],  # the model has no q bias: zeros beside the gate's
                       torch.cat([torch.cat([torch.zeros(D), gb[h * D:(h + 1) * D]]) for h in range(H)]))
    assert torch.equal(out[attn + "o_proj.weight"], w[attn + "o_proj.weight"])


def test_a_headwise_gate_is_repeated_over_the_head_or_kept_per_kv_group(tmp_path):
    tmap, config, w = saved(tmp_path / "g", gate_granularity="headwise")
    attn = "model.layers.0.self_attn."
    q, g = w[attn + "q_proj.weight"], w[attn + "gate.g_proj.weight"]  # g: [H, hidden], one score a head
    steps.gate_rows_into_q_proj(tmap, config, 0, width=D, groups=H, bias=False)
    assert torch.equal(written(tmap, config)[attn + "q_proj.weight"],
                       torch.cat([torch.cat([q[h * D:(h + 1) * D], g[h:h + 1].expand(D, -1)]) for h in range(H)]))
    tmap, config, w = saved(tmp_path / "r", gate_granularity="headwise")
    steps.gate_rows_into_q_proj(tmap, config, 0, width=1, groups=K, bias=False)
    assert torch.equal(written(tmap, config)[attn + "q_proj.weight"],
                       torch.cat([torch.cat([q[k * G * D:(k + 1) * G * D], g[k * G:(k + 1) * G]]) for k in range(K)]))


def test_a_constant_gate_is_zero_rows_and_o_proj_times_twice_its_value(tmp_path):
    tmap, config, w = saved(tmp_path / "c", gate_input_dependent=False, gate_layers=[1])
    for layer in (0, 1):
        steps.gate_rows_into_q_proj(tmap, config, layer, width=D, groups=H, bias=False)
    out = written(tmap, config)
    for layer, value in ((0, torch.ones(H, D)), (1, torch.sigmoid(w["model.layers.1.self_attn.gate.logits"].double()))):
        attn = f"model.layers.{layer}.self_attn."
        packed = out[attn + "q_proj.weight"].view(H, 2 * D, -1)
        assert torch.equal(packed[:, :D].reshape(H * D, -1), w[attn + "q_proj.weight"])
        assert not packed[:, D:].any()  # sigmoid(0) = 0.5 whatever the input
        o_proj = w[attn + "o_proj.weight"]  # [hidden, H*D]: column h*D + i is scaled by 2 * value[h, i]
        scaled = (o_proj.double() * 2 * value.expand(H, D).reshape(1, H * D)).to(o_proj.dtype)
        assert torch.equal(out[attn + "o_proj.weight"], scaled)


def test_zero_biases_have_the_projections_out_features(tmp_path):
    tmap, config, w = saved(tmp_path / "g")
    steps.zero_biases(tmap, 0, ("k_proj", "o_proj"))
    out = written(tmap, config)
    for proj in ("k_proj", "o_proj"):
        name = f"model.layers.0.self_attn.{proj}."
        assert torch.equal(out[name + "bias"], torch.zeros(w[name + "weight"].shape[0]))
    assert "model.layers.0.self_attn.v_proj.bias" not in out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_are_zero_centred_in_float32_or_kept(tmp_path, dtype):
    names = ["model.norm.weight", *(f"model.layers.1.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"))]
    tmap, config, w = saved(tmp_path / "n", dtype=dtype)
    steps.norms(tmap, 1, zero_centred=True)
    steps.norms(tmap, None, zero_centred=True)
    out = written(tmap, config)
    for name in names:  # Qwen3.5's norm computes x̂·(1 + w'): w' = w - 1, exact in float32
        assert out[name].dtype == torch.float32 and torch.equal(out[name], w[name].float() - 1)
    tmap, config, _ = saved(tmp_path / "k", dtype=dtype)
    steps.norms(tmap, 1, zero_centred=False)
    steps.norms(tmap, None, zero_centred=False)
    assert all(tmap.planned(name) for name in names)  # put by the step, not passed through by copy_rest
    out = written(tmap, config)
    for name in names:
        assert out[name].dtype == dtype and torch.equal(out[name], w[name])


def test_experts_are_stacked_per_projection_from_either_layout():
    E, inner, hidden = 3, 4, 5
    per_expert = {(e, p): torch.randn(hidden if p == "down" else inner, inner if p == "down" else hidden)
                  for e in range(E) for p in ("gate", "up", "down")}
    prefix = "model.layers.2.mlp.experts."
    plan = {f"{prefix}{e}.{p}_proj.weight": TensorPlan(tuple(t.shape), t.dtype, lambda t=t: t)
            for (e, p), t in per_expert.items()}
    plan["model.layers.2.mlp.gate.weight"] = TensorPlan((E, hidden), torch.float32, lambda: torch.zeros(E, hidden))
    stacked = steps.stacked_experts(plan, 2, E)
    assert list(plan) == ["model.layers.2.mlp.gate.weight"]  # the experts are taken out, the router stays
    for p in ("gate", "up", "down"):
        manual = torch.stack([per_expert[(e, p)] for e in range(E)])
        assert stacked[f"{p}_proj"].shape == tuple(manual.shape) and torch.equal(stacked[f"{p}_proj"].make(), manual)

    gate_up, down = torch.randn(E, 2 * inner, hidden), torch.randn(E, hidden, inner)  # Transformers' fused layout
    plan = {prefix + "gate_up_proj": TensorPlan(tuple(gate_up.shape), gate_up.dtype, lambda: gate_up),
            prefix + "down_proj": TensorPlan(tuple(down.shape), down.dtype, lambda: down)}
    stacked = steps.stacked_experts(plan, 2, E)
    assert not plan
    for p, manual in (("gate", gate_up[:, :inner]), ("up", gate_up[:, inner:]), ("down", down)):
        assert stacked[f"{p}_proj"].shape == tuple(manual.shape) and torch.equal(stacked[f"{p}_proj"].make(), manual)
