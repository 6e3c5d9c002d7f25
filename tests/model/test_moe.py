"""The mixture-of-experts GatedQwen (GatedQwenMoeConfig / GatedQwenMoeForCausalLM) against independent references:
stock Qwen3-MoE and Qwen3-Next with the same weights, and the G1 gate plus top-k routing written out here in plain
PyTorch; and its separation from the dense model (no experts machinery on a dense GatedQwen, each class refusing the
other's folders)."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Trainer,
    TrainingArguments,
)
from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func as switch_z_loss

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM, GatedQwenMoeConfig, GatedQwenMoeForCausalLM
from gated_qwen.cli import main as cli
from gated_qwen.conversion import ConversionError
from gated_qwen.model.configuration_gated import CONFIG_ERRORS
from gated_qwen.model.gating import gate_parameters_per_layer, gated_layers
from gated_qwen.model.modeling_gated_moe import GatedQwenMoeSparseMoeBlock, router_z_loss_func
from tests.helpers import SMALL, TINY_MOE, bare_environment, gate_variants, randomize_, sizes

VOCAB = 97  # the load-balancing test's starting router is tuned on this vocabulary


def tiny(**overrides) -> dict:
    return sizes({**SMALL, **TINY_MOE, "vocab_size": VOCAB}, **overrides)


def gated(seed=0, **overrides) -> GatedQwenMoeForCausalLM:
    torch.manual_seed(seed)
    return randomize_(GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**tiny(**overrides))), seed).eval()


def ids(batch=2, length=12, seed=1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def left_padding_mask(batch=2, length=12) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :4] = 0
    return mask


# ------------------------------------------------------------------------------------------ the configuration
def test_dense_default_is_unchanged():
    """The dense config has no mixture-of-experts field, and its model no sparse block."""
    config = GatedQwenConfig()
    assert not hasattr(config, "num_experts") and not hasattr(config, "sparse_layers")
    model = GatedQwenForCausalLM(GatedQwenConfig(**sizes(SMALL, vocab_size=VOCAB)))
    assert not hasattr(model.config, "num_experts")
    assert not any(isinstance(m, GatedQwenMoeSparseMoeBlock) for m in model.modules())


@pytest.mark.parametrize(
    "config_class, fields, message",
    [
        (GatedQwenMoeConfig, dict(num_experts=-1),
         "`num_experts` must be a positive integer (a GatedQwenMoeConfig has experts; a dense model is a "
         "GatedQwenConfig), got -1"),
        (GatedQwenMoeConfig, dict(num_experts=0), "`num_experts` must be a positive integer"),
        (GatedQwenMoeConfig, dict(num_experts=4, num_experts_per_tok=5),
         "`num_experts_per_tok` (5) must be at most `num_experts` (4)"),
        (GatedQwenConfig, dict(num_experts=0), "`num_experts`=0 asks for a mixture of experts, which GatedQwenConfig"),
        (GatedQwenConfig, dict(), "`num_experts`=8 asks for a mixture of experts, which GatedQwenConfig (the dense "
                                  "model, model_type 'gated_qwen') does not have; use GatedQwenMoeConfig"),
        (GatedQwenMoeConfig, dict(mlp_only_layers=[2]), "`mlp_only_layers` must hold distinct indices in [0, 2)"),
        (GatedQwenMoeConfig, dict(mlp_only_layers=[0, 1]), "no layer is sparse"),
        (GatedQwenMoeConfig, dict(decoder_sparse_step=0), "`decoder_sparse_step` must be a positive integer, got 0"),
        (GatedQwenMoeConfig, dict(router_z_loss_coef=-0.1), "`router_z_loss_coef` must be a number >= 0, got -0.1"),
        (GatedQwenMoeConfig, dict(norm_topk_prob="yes"), "Field 'norm_topk_prob' expected bool, got str (value: 'yes')"),
        (GatedQwenMoeConfig, dict(shared_expert_intermediate_size=-2),
         "`shared_expert_intermediate_size` must be 0 (no shared expert)"),
    ],
)
def test_bad_moe_fields_are_refused_with_the_reason(config_class, fields, message):
    with pytest.raises(CONFIG_ERRORS) as error:
        config_class(**tiny(**fields))
    assert message in str(error.value)


def test_assignment_after_construction_is_checked():
    """As for the gate fields (test_config.py): a bad mixture-of-experts value set on a built config is refused,
    naming the field; on a dense config, setting experts is refused, naming the mixture-of-experts class."""
    config = GatedQwenMoeConfig(**tiny())
    for field, value, allowed in (("num_experts", -1, "positive integer"), ("decoder_sparse_step", 0, "positive"),
                                  ("router_aux_loss_coef", -1.0, ">= 0")):
        before = getattr(config, field)
        with pytest.raises(CONFIG_ERRORS) as error:
            setattr(config, field, value)
        assert field in str(error.value) and allowed in str(error.value), str(error.value)
        assert getattr(config, field) == before
    dense = GatedQwenConfig(**sizes(SMALL))
    with pytest.raises(CONFIG_ERRORS, match="`num_experts`=4 asks for a mixture of experts.*GatedQwenMoeConfig"):
        dense.num_experts = 4
    assert not hasattr(dense, "num_experts")


def test_sparse_layers_follow_qwen3_moe():
    config = GatedQwenMoeConfig(**tiny(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    stock = Qwen3MoeConfig(**tiny(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    stock_model = Qwen3MoeForCausalLM(stock)
    expected = [i for i, layer in enumerate(stock_model.model.layers) if hasattr(layer.mlp, "experts")]
    assert config.sparse_layers == expected == [1, 5]


def test_parallel_plans_are_qwen3_moe_and_qwen3_next_plans():
    """Qwen3-MoE's rules (Qwen3-Next's for the shared expert) wherever the config has those parameters, and no
    expert rule on a dense config."""
    moe, nxt = Qwen3MoeConfig.base_model_tp_plan, Qwen3NextConfig.base_model_tp_plan
    ours = GatedQwenMoeConfig(**tiny(shared_expert_intermediate_size=24, mlp_only_layers=[0])).base_model_tp_plan
    for key in moe:
        assert ours[key] == moe[key], key
    for key in (k for k in nxt if "shared_expert" in k):
        assert ours[key] == nxt[key], key
    assert GatedQwenMoeConfig(**tiny()).base_model_ep_plan == Qwen3MoeConfig.base_model_ep_plan
    dense = GatedQwenConfig(**sizes(SMALL))
    assert not any("expert" in rule for rule in dense.base_model_tp_plan) and dense.base_model_ep_plan is None


# ------------------------------------------------------------------------ dense and MoE: separate model types
def test_only_the_moe_classes_have_experts_machinery(monkeypatch):
    """What Transformers reads to treat a class as a mixture of experts: the experts decorator in the class's
    source file, `router_logits` in its outputs, the expert key mapping (registered when a model is built, as in a
    fresh process: Transformers' registry starts here as a fresh process has it, whatever ran before). The dense
    classes have none of them."""
    from transformers import conversion_mapping
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    monkeypatch.setattr(conversion_mapping, "_checkpoint_conversion_mapping_cache", None)
    monkeypatch.setattr(conversion_mapping, "USER_REGISTERED_MAPPINGS", set())

    from gated_qwen.model.modeling_gated import GatedQwenCausalLMOutputWithPast, GatedQwenModelOutputWithPast

    assert not GatedQwenForCausalLM._can_set_experts_implementation()
    assert GatedQwenMoeForCausalLM._can_set_experts_implementation()
    for output in (GatedQwenModelOutputWithPast, GatedQwenCausalLMOutputWithPast):
        assert not {"router_logits", "aux_loss"} & set(output.__dataclass_fields__), output
        assert "gate_logits" in output.__dataclass_fields__
    assert "router_logits" in GatedQwenMoeForCausalLM.forward.__annotations__["return"].__dataclass_fields__
    assert "output_router_logits" not in GatedQwenConfig().to_dict()
    assert get_checkpoint_conversion_mapping("gated_qwen_moe") is None  # nothing registered before a model is built
    # what a model built from each config is given, whichever kind is built first: Qwen3's and Qwen3-MoE's
    dense = GatedQwenForCausalLM(GatedQwenConfig(**sizes(SMALL))).config._experts_implementation
    moe = GatedQwenMoeForCausalLM(GatedQwenMoeConfig(**tiny())).config._experts_implementation
    assert get_checkpoint_conversion_mapping("gated_qwen") is None  # a dense folder loads with no conversion at all
    moe_sources = [str(t.source_patterns) for t in get_checkpoint_conversion_mapping("gated_qwen_moe")]
    assert moe_sources == [str(t.source_patterns) for t in get_checkpoint_conversion_mapping("qwen3_moe")]
    assert any("experts" in p for p in moe_sources)  # Qwen3-MoE's experts, one tensor each on disk
    assert dense == Qwen3ForCausalLM(Qwen3Config(**sizes(SMALL))).config._experts_implementation == "eager"
    assert moe == Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny())).config._experts_implementation == "grouped_mm"


def test_the_classes_refuse_a_config_of_the_other_model_type():
    with pytest.raises(ValueError, match="GatedQwenForCausalLM builds model_type 'gated_qwen'.*use "
                                         "GatedQwenMoeForCausalLM"):
        GatedQwenForCausalLM(GatedQwenMoeConfig(**tiny()))
    with pytest.raises(ValueError, match="GatedQwenMoeForCausalLM builds model_type 'gated_qwen_moe'.*use "
                                         "GatedQwenForCausalLM"):
        GatedQwenMoeForCausalLM(GatedQwenConfig(**sizes(SMALL)))


@pytest.mark.parametrize("name, config_class", [("dense-1.7b-28l", GatedQwenConfig),
                                                ("dense-1.7b-48l", GatedQwenConfig),
                                                ("moe-15a2b", GatedQwenMoeConfig)])
def test_from_paper_returns_the_class_of_the_preset_whichever_class_it_is_called_on(name, config_class):
    for caller in (GatedQwenConfig, GatedQwenMoeConfig):
        config = caller.from_paper(name, gate_granularity="headwise")
        assert type(config) is config_class and config.gate_granularity == "headwise"
    assert (config_class is GatedQwenMoeConfig) == (GatedQwenConfig.from_paper(name).model_type == "gated_qwen_moe")


@pytest.fixture
def moe_folder(tmp_path) -> Path:
    """A saved GatedQwen-MoE with a shared expert (what `--to qwen3_next` exports), and its logits."""
    model = gated(seed=4, shared_expert_intermediate_size=24)
    model.save_pretrained(tmp_path / "moe")
    with torch.no_grad():
        torch.save(model(ids()).logits, tmp_path / "moe-logits.pt")
    return tmp_path / "moe"


def test_each_class_refuses_a_folder_of_the_other_model_type(moe_folder, tmp_path):
    """A gated_qwen_moe folder: the MoE class and the Auto classes read it (its auto_map names the MoE classes);
    the dense class refuses it, naming the MoE class, and the MoE class refuses a dense folder, naming the dense one."""
    saved = json.loads((moe_folder / "config.json").read_text())
    assert saved["model_type"] == "gated_qwen_moe"
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_gated_moe.GatedQwenMoeForCausalLM"
    assert saved["auto_map"]["AutoConfig"] == "configuration_gated_moe.GatedQwenMoeConfig"
    for model in (GatedQwenMoeForCausalLM.from_pretrained(moe_folder), AutoModelForCausalLM.from_pretrained(moe_folder)):
        assert type(model) is GatedQwenMoeForCausalLM
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(ids()).logits, torch.load(moe_folder.parent / "moe-logits.pt"),
                                       rtol=0, atol=0)
    assert type(AutoConfig.from_pretrained(moe_folder)) is GatedQwenMoeConfig
    with pytest.raises(ValueError, match="holds a mixture of experts.*GatedQwenMoeForCausalLM"):
        GatedQwenForCausalLM.from_pretrained(moe_folder)
    GatedQwenForCausalLM(GatedQwenConfig(**sizes(SMALL))).save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="holds a dense model.*GatedQwenForCausalLM"):
        GatedQwenMoeForCausalLM.from_pretrained(tmp_path / "dense")


def test_a_mixture_of_experts_exports_to_qwen3_next_only(moe_folder, tmp_path):
    """`--to qwen3_next` exports it (verified by the converter, and here against the logits saved with it, through
    the stock class); the dense-only exports refuse it with the reason."""
    from gated_qwen.conversion import convert

    convert(moe_folder, tmp_path / "next", to_format="qwen3_next", verify=True)
    stock = Qwen3NextForCausalLM.from_pretrained(tmp_path / "next").eval()
    with torch.no_grad():
        torch.testing.assert_close(stock(ids()).logits, torch.load(moe_folder.parent / "moe-logits.pt"),
                                   rtol=1e-5, atol=1e-5)
    for target in ("qwen3_5", "release"):
        with pytest.raises(ConversionError, match=r"SRC is a mixture-of-experts GatedQwen \(num_experts=8\); this "
                                                  "converter handles dense models only"):
            convert(moe_folder, tmp_path / target, to_format=target)
        assert not (tmp_path / target).exists()


# ---------------------------------------------------------------------------------------- the paper's 15A2B
def test_paper_moe_preset_parameter_counts():
    """Active parameters per token = embeddings + lm_head + L * (attention [+ gate] + router + k experts), i.e.
    2 V d + L (d (2 H + 2 K) D + E d + k 3 d I) without a gate (norms add ~0.1M). The paper calls the model 15A2B
    and quotes 2.54B active; with its stated sizes (V 151936, d 2048, L 24, H 32, K 4, D 128, E 128, k 8,
    I 768) this formula gives 1.99B active and 15.6B total (the same formula gives Qwen3-30B-A3B's published
    30.5B / 3.3B): the 2.54B cannot be reached from those sizes, so this test checks the formula's numbers."""
    with torch.device("meta"):
        base = GatedQwenMoeForCausalLM(GatedQwenMoeConfig.from_paper("moe-15a2b", gate_position=None))
        gated_model = GatedQwenMoeForCausalLM(GatedQwenMoeConfig.from_paper("moe-15a2b"))
    c = base.config
    V, d, L, H, K, D, E, k, I = (  # noqa: E741 (the paper's symbols)
        c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
        c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
    )
    assert (V, d, L, H, K, D, E, k, I) == (151936, 2048, 24, 32, 4, 128, 128, 8, 768)
    assert not c.tie_word_embeddings and c.use_qk_norm and c.output_router_logits
    norms = L * (2 * d + 2 * D) + d
    attention, router, expert = d * (2 * H + 2 * K) * D, E * d, 3 * d * I
    total = 2 * V * d + L * (attention + router + E * expert) + norms
    active = 2 * V * d + L * (attention + router + k * expert) + norms
    assert sum(p.numel() for p in base.parameters()) == total
    assert 15.0e9 < total < 16.0e9 and 1.95e9 < active < 2.05e9
    # Gated variants add the gate on top, experts untouched (table 1: +201M for G1 elementwise).
    added = sum(p.numel() for p in gated_model.parameters()) - total
    assert added == d * H * D * L == 201_326_592
    assert gated_model.config.moe_intermediate_size == I
    headwise = GatedQwenMoeConfig.from_paper("moe-15a2b", gate_granularity="headwise")
    assert gate_parameters_per_layer(headwise) * L == d * H * L  # 1.6M


# ------------------------------------------------------------------------------- stock-model equivalence
@pytest.mark.parametrize("experts_implementation", ["grouped_mm", "batched_mm", "eager"])
def test_no_gate_equals_stock_qwen3_moe(experts_implementation):
    overrides = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, output_router_logits=True,
                     router_aux_loss_coef=0.1)
    model = gated(seed=2, gate_position=None, **overrides)
    stock = Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny(**overrides))).eval()
    stock.load_state_dict(model.state_dict(), strict=True)
    for m in (model, stock):
        m.set_experts_implementation(experts_implementation)
    x, mask = ids(), left_padding_mask()
    with torch.no_grad():
        ours, theirs = model(x, attention_mask=mask, labels=x), stock(x, attention_mask=mask, labels=x)
    assert torch.allclose(ours.logits, theirs.logits, atol=1e-5)
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    for a, b in zip(ours.router_logits, theirs.router_logits):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(ours.aux_loss, theirs.aux_loss, atol=1e-6)
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-5)  # CE + 0.1 * aux; z-loss off by default


def test_router_z_loss_is_st_moe_z_loss_and_joins_the_loss():
    model = gated(seed=3, output_router_logits=True, router_aux_loss_coef=0.01, router_z_loss_coef=0.1)
    x, mask = ids(), left_padding_mask()
    with torch.no_grad():
        out = model(x, labels=x)
        plain = model(x, labels=x, output_router_logits=False)
        masked = model(x, attention_mask=mask, output_router_logits=True)
    z = switch_z_loss(torch.stack(out.router_logits))  # [layers, tokens, experts]: mean of logsumexp^2
    assert torch.allclose(router_z_loss_func(out.router_logits), z)
    assert torch.allclose(out.loss, plain.loss + 0.01 * out.aux_loss + 0.1 * z, atol=1e-6)
    assert plain.aux_loss is None and plain.router_logits is None
    keep = mask.reshape(-1).bool()
    z_masked = switch_z_loss(torch.stack([r[keep] for r in masked.router_logits]))
    assert torch.allclose(router_z_loss_func(masked.router_logits, mask), z_masked)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """`x: [B, S, heads, D]` rotated by position (the two halves of each head form the complex pairs)."""
    seq, dim = x.shape[1], x.shape[-1]
    angles = torch.arange(seq)[:, None] * theta ** (-torch.arange(0, dim, 2) / dim)[None]  # [S, D/2]
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


G1_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu, "ns_sigmoid": lambda z: 0.5 + 0.5 * torch.sigmoid(z),
                  "identity": lambda z: z}


def reference_forward(model: GatedQwenMoeForCausalLM, input_ids: torch.Tensor):
    """The paper's G1-gated decoder with top-k softmax-routed SwiGLU experts (+ sigmoid-gated shared expert),
    from the parameters by name: `input_ids: [B, S]` -> `(logits [B, S, V], router logits per sparse layer)`."""
    c, p = model.config, dict(model.named_parameters())
    eps, theta = c.rms_norm_eps, c.rope_parameters["rope_theta"]
    batch, seq = input_ids.shape
    heads, kv, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    causal = torch.full((seq, seq), float("-inf")).triu(1)
    x = p["model.embed_tokens.weight"][input_ids]
    routers = []
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        h = rms(x, p[pre + "input_layernorm.weight"], eps)
        q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(batch, seq, heads, dim)
        k = (h @ p[pre + "self_attn.k_proj.weight"].T).view(batch, seq, kv, dim)
        v = (h @ p[pre + "self_attn.v_proj.weight"].T).view(batch, seq, kv, dim)
        q = rope(rms(q, p[pre + "self_attn.q_norm.weight"], eps), theta)
        k = rope(rms(k, p[pre + "self_attn.k_norm.weight"], eps), theta).repeat_interleave(heads // kv, dim=2)
        v = v.repeat_interleave(heads // kv, dim=2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(dim) + causal
        y = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)  # [B, S, H, D]
        if i in gated_layers(c):  # G1: Y' = Y * act(X W_g) (or Y + act(X W_g)), X = the normed input of q/k/v
            if c.gate_input_dependent:
                logits = h @ p[pre + "self_attn.gate.g_proj.weight"].T
                if c.gate_bias:
                    logits = logits + p[pre + "self_attn.gate.g_proj.bias"]
            else:
                logits = p[pre + "self_attn.gate.logits"]
            g_heads = 1 if c.gate_shared_across_heads else heads
            g_width = dim if c.gate_granularity == "elementwise" else 1
            score = G1_ACTIVATIONS[c.gate_activation](logits.reshape(*logits.shape[:-1], g_heads, g_width)
                                                       if c.gate_input_dependent else logits)
            y = y * score if c.gate_combine == "multiply" else y + score
        x = x + y.reshape(batch, seq, heads * dim) @ p[pre + "self_attn.o_proj.weight"].T

        h = rms(x, p[pre + "post_attention_layernorm.weight"], eps).reshape(batch * seq, -1)
        if i in c.sparse_layers:
            router = h @ p[pre + "mlp.gate.weight"].T  # [T, E]
            routers.append(router)
            top_p, top_e = router.softmax(-1).topk(c.num_experts_per_tok, dim=-1)  # [T, k]
            if c.norm_topk_prob:
                top_p = top_p / top_p.sum(-1, keepdim=True)
            gate, up = torch.einsum("tkoh,th->tko", p[pre + "mlp.experts.gate_up_proj"][top_e], h).chunk(2, dim=-1)
            out = torch.einsum("tkhi,tki->tkh", p[pre + "mlp.experts.down_proj"][top_e], F.silu(gate) * up)
            out = (top_p[..., None] * out).sum(1)
            if c.shared_expert_intermediate_size:
                s = pre + "mlp.shared_expert."
                shared = (F.silu(h @ p[s + "gate_proj.weight"].T) * (h @ p[s + "up_proj.weight"].T))
                shared = shared @ p[s + "down_proj.weight"].T
                out = out + torch.sigmoid(h @ p[pre + "mlp.shared_expert_gate.weight"].T) * shared
        else:
            out = (F.silu(h @ p[pre + "mlp.gate_proj.weight"].T) * (h @ p[pre + "mlp.up_proj.weight"].T))
            out = out @ p[pre + "mlp.down_proj.weight"].T
        x = x + out.view(batch, seq, -1)
    x = rms(x, p["model.norm.weight"], eps)
    return x @ p["lm_head.weight"].T, routers


G1_VARIANTS = {name: fields for name, fields in gate_variants().items() if name.startswith("G1-")} | {
    "bias-shared-expert-dense-layer": dict(gate_bias=True, shared_expert_intermediate_size=24, num_hidden_layers=3,
                                           mlp_only_layers=[1], norm_topk_prob=True),
}


@pytest.mark.parametrize("variant", G1_VARIANTS, ids=list(G1_VARIANTS))
def test_g1_variants_match_the_formula(variant):
    model = gated(seed=4, output_router_logits=True, **G1_VARIANTS[variant])
    x = ids()
    with torch.no_grad():
        out = model(x)
        logits, routers = reference_forward(model, x)
    assert torch.allclose(out.logits, logits, atol=1e-5), (out.logits - logits).abs().max()
    assert len(out.router_logits) == len(routers)
    for a, b in zip(out.router_logits, routers):
        assert torch.allclose(a, b, atol=1e-6)


def to_qwen3_next_state_dict(model: GatedQwenMoeForCausalLM) -> dict[str, torch.Tensor]:
    """Qwen3-Next's layout of the same function: per-head `[q_h | gate_h]` rows in q_proj, norms stored as w - 1."""
    heads, out = model.config.num_attention_heads, {}
    state = model.state_dict()
    for name, tensor in state.items():
        if name.endswith("gate.g_proj.weight"):
            continue
        if name.endswith("q_proj.weight"):
            gate = state[name.replace("q_proj", "gate.g_proj")]
            tensor = torch.cat([tensor.view(heads, -1, tensor.shape[-1]), gate.view(heads, -1, gate.shape[-1])], 1)
            tensor = tensor.reshape(-1, tensor.shape[-1])
        elif name.endswith("norm.weight"):  # input/post_attention_layernorm, q_norm, k_norm, the final norm
            tensor = tensor - 1
        out[name] = tensor
    return out


def qwen3_next_config(**overrides) -> Qwen3NextConfig:
    fields = tiny(shared_expert_intermediate_size=24, **overrides)
    layers = fields["num_hidden_layers"]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    return Qwen3NextConfig(**fields, layer_types=["full_attention"] * layers, rope_parameters=rope)


def test_default_gate_with_shared_expert_equals_stock_qwen3_next():
    overrides = dict(num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True, output_router_logits=True)
    model = gated(seed=5, shared_expert_intermediate_size=24, **overrides)
    stock = Qwen3NextForCausalLM(qwen3_next_config(**overrides)).eval()
    stock.load_state_dict(to_qwen3_next_state_dict(model), strict=True)
    x = ids()
    with torch.no_grad():
        ours, theirs = model(x, labels=x), stock(x, labels=x)
    assert torch.allclose(ours.logits, theirs.logits, atol=1e-5)
    for a, b in zip(ours.router_logits, theirs.router_logits, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(ours.aux_loss, theirs.aux_loss, atol=1e-6)
    assert torch.allclose(ours.loss, theirs.loss, atol=1e-5)


# --------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("add_gate", [None, "elementwise", "headwise"])
def test_convert_from_stock_qwen3_moe(tmp_path, add_gate):
    torch.manual_seed(6)
    stock = randomize_(Qwen3MoeForCausalLM(Qwen3MoeConfig(**tiny(mlp_only_layers=[0], num_hidden_layers=2))), 6)
    stock.save_pretrained(tmp_path / "stock")  # Transformers writes the experts one tensor each, as on the Hub
    args = ["convert", str(tmp_path / "stock"), str(tmp_path / "gated"), "--from", "qwen3_moe", "--no-verify"]
    assert cli(args + (["--add-gate", add_gate] if add_gate else [])) == 0
    model = GatedQwenMoeForCausalLM.from_pretrained(tmp_path / "gated").eval()
    assert model.config.sparse_layers == [1] and model.config.gate_position == ("sdpa" if add_gate else None)
    if add_gate:
        assert model.config.gate_granularity == add_gate
    x = ids()
    with torch.no_grad():
        assert torch.allclose(model(x).logits, stock.eval()(x).logits, atol=1e-5)


def test_convert_to_and_from_qwen3_next(tmp_path):
    model = gated(seed=7, shared_expert_intermediate_size=24, norm_topk_prob=True)
    model.save_pretrained(tmp_path / "gated")
    assert cli(["convert", str(tmp_path / "gated"), str(tmp_path / "next"), "--to", "qwen3_next", "--no-verify"]) == 0
    stock = Qwen3NextForCausalLM.from_pretrained(tmp_path / "next").eval()
    assert set(stock.config.layer_types) == {"full_attention"}
    assert stock.config.rope_parameters["partial_rotary_factor"] == 1.0
    assert cli(["convert", str(tmp_path / "next"), str(tmp_path / "back"), "--from", "qwen3_next", "--no-verify"]) == 0
    back = GatedQwenMoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.shared_expert_intermediate_size == 24 and back.config.num_experts == 8
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
        assert torch.allclose(stock(x).logits, expected, atol=1e-5)
        assert torch.allclose(back(x).logits, expected, atol=1e-5)

    gated(seed=7).save_pretrained(tmp_path / "no_shared")  # Qwen3-Next's sparse layers always have a shared expert
    with pytest.raises(ConversionError, match="always have a shared expert"):
        from gated_qwen.conversion import convert

        convert(tmp_path / "no_shared", tmp_path / "refused", to_format="qwen3_next")
    assert not (tmp_path / "refused").exists()


# ------------------------------------------------------------------------- generation, training, save/load
def test_generation_with_cache_equals_without():
    model = gated(seed=8, shared_expert_intermediate_size=24, output_router_logits=True)
    x, mask = ids(length=8), left_padding_mask(length=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        cached = model.generate(x, use_cache=True, **kwargs)
        uncached = model.generate(x, use_cache=False, **kwargs)
    assert cached.shape == (2, 14) and torch.equal(cached, uncached)


def test_gradient_checkpointing_gives_the_same_gradients():
    x = ids()
    grads = []
    for checkpointing in (False, True):
        model = gated(seed=9, shared_expert_intermediate_size=24, output_router_logits=True,
                      router_z_loss_coef=0.01).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model(x, labels=x).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    assert grads[0]["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name


REMOTE_CODE_CHECK = r"""
import sys, torch
sys.modules["gated_qwen"] = None  # the package is not installed on this machine
from transformers import AutoModelForCausalLM
path, expected = sys.argv[1], torch.load(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
with torch.no_grad():
    out = model(expected["ids"], output_router_logits=True)
assert torch.equal(out.logits, expected["logits"])
assert all(torch.equal(a, b) for a, b in zip(out.router_logits, expected["router_logits"], strict=True))
print("remote code ok")
"""


@pytest.mark.slow  # a fresh interpreter or several processes
def test_save_load_and_remote_code_without_the_package(tmp_path):
    import subprocess
    import sys

    from safetensors import safe_open

    model = gated(seed=10, shared_expert_intermediate_size=24, gate_granularity="headwise")
    model.save_pretrained(tmp_path / "model")
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:  # Qwen3-MoE's on-disk layout
        assert "model.layers.0.mlp.experts.7.down_proj.weight" in f.keys()
    loaded = GatedQwenMoeForCausalLM.from_pretrained(tmp_path / "model").eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    x = ids()
    with torch.no_grad():
        out = model(x, output_router_logits=True)
    torch.save({"ids": x, "logits": out.logits, "router_logits": out.router_logits}, tmp_path / "expected.pt")
    env = bare_environment(tmp_path / "hf_home")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_CHECK, str(tmp_path / "model"), str(tmp_path / "expected.pt")],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote code ok" in result.stdout
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").config.num_experts == 8


def test_analyze_reads_a_mixture_of_experts_folder(tmp_path):
    """`gated-qwen analyze` loads a GatedQwen-MoE folder with its class and reports what `analyze` measures on the
    model itself."""
    pytest.importorskip("matplotlib", reason="needs the analysis extra: pip install 'gated-qwen[analysis]'")
    from safetensors.torch import save_file

    from gated_qwen.analysis import analyze

    model = gated(seed=12, shared_expert_intermediate_size=24, mlp_only_layers=[0])
    model.save_pretrained(tmp_path / "model")
    x = ids(length=12)
    save_file({"input_ids": x}, tmp_path / "ids.safetensors")
    assert cli(["analyze", str(tmp_path / "model"), "--tokens", str(tmp_path / "ids.safetensors"), "--length", "12",
                "--sequences", "2", "--out", str(tmp_path / "report")]) == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())["summary"]
    model.set_attn_implementation("sdpa")
    direct = analyze(model, x)["summary"]
    for key in ("first_token_attention", "max_activation", "gate_mean"):
        assert report[key] == pytest.approx(direct[key], rel=1e-5), key


def test_trainer_reduces_the_load_balancing_loss(tmp_path):
    """Starts from a router that sends every token to experts 0 and 1 (all embeddings share a direction the
    router favours); the load-balancing loss (k = 2 when perfectly balanced, up to E = 8) must fall."""
    model = gated(seed=11, output_router_logits=True, router_aux_loss_coef=0.5)
    with torch.no_grad():
        common = torch.randn(64, generator=torch.Generator().manual_seed(0))
        model.model.embed_tokens.weight.add_(0.1 * common)
        for layer in model.model.layers:
            layer.mlp.gate.weight[:2] += 0.05 * common * layer.post_attention_layernorm.weight
    probe = ids(batch=4, length=16, seed=99)

    def balance() -> float:
        model.eval()
        with torch.no_grad():
            return model(probe).aux_loss.item()

    before = balance()
    data = [{"input_ids": row, "labels": row} for row in ids(batch=64, length=16, seed=12)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2,
                             report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=data).train()
    after = balance()
    assert before > 5.0 and after < 0.6 * before, (before, after)


def test_the_dense_config_refuses_by_name_every_field_the_mixture_of_experts_adds():
    """configuration_gated.py (shipped without the mixture of experts' file) lists the fields GatedQwenMoeConfig
    adds, to name them in its refusal: the list is exactly those fields."""
    from gated_qwen.model import configuration_gated

    added = set(GatedQwenMoeConfig.__dataclass_fields__) - set(GatedQwenConfig.__dataclass_fields__)
    assert set(configuration_gated.MOE_FIELDS) == added
    for field in sorted(added):
        with pytest.raises(CONFIG_ERRORS, match=f"`{field}`=.* asks for a mixture of experts"):
            GatedQwenConfig(**{field: GatedQwenMoeConfig.__dataclass_fields__[field].default or 1})

