"""Perplexity on any GatedQwen model: the mean next-token loss, against context length with and without YaRN
(`perplexity_by_length`, what `gated-qwen eval-ppl` prints), which rotary frequencies YaRN changes (`yarn_bands`),
and recall accuracy at the positions that need a token from far back (`recall_accuracy`)."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .measure import _decoder


@torch.no_grad()
def mean_nll(model, input_ids: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token negative log-likelihood (nats) of `model` over `input_ids: [N, S]`: every position 1..S-1
    predicted from the ones before it."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in input_ids.split(batch_size):
        batch = batch.to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
        logits = logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
        total += F.cross_entropy(logits, batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


@torch.no_grad()
def recall_accuracy(model, input_ids: torch.Tensor, targets: torch.Tensor, batch_size: int = 8) -> dict:
    """How well `model` retrieves: at the positions `targets` marks (`[N, S]` bool, e.g. a value whose key's fact
    lies far back; position 0 is never one), the share where its most likely next token, predicted from the
    positions before, is the token there (`accuracy`), their mean negative log-likelihood (`nll`, nats) and their
    number (`positions`). `input_ids: [N, S]`."""
    if targets.shape != input_ids.shape or targets[:, 0].any():
        raise ValueError(f"`targets` must be a bool mask of shape {tuple(input_ids.shape)} without position 0.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits, nll, count = 0, 0.0, 0
    for batch, marked in zip(input_ids.split(batch_size), targets.split(batch_size)):
        batch, marked = batch.to(device), marked[:, 1:].to(device)
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))[marked]  # [positions, vocab]
        wanted = batch[:, 1:][marked]
        hits += (logits.argmax(-1) == wanted).sum().item()
        nll += F.cross_entropy(logits, wanted, reduction="sum").item()
        count += wanted.numel()
    model.train(was_training)
    return {"accuracy": hits / count if count else math.nan, "nll": nll / count if count else math.nan,
            "positions": count}


def with_yarn(model, factor: float, original_max_position_embeddings: int | None = None):
    """A copy of `model` whose rotary embedding uses YaRN with `factor` (context `factor` times the original).

    The original length is `original_max_position_embeddings`, else the one in the model's YaRN parameters, else
    `config.max_position_embeddings` (the training context).
    """
    if not factor > 1:
        raise ValueError(f"YaRN `factor` must be > 1 (the context extension ratio), got {factor!r}.")
    model = copy.deepcopy(model)
    config = model.config
    rope = dict(config.rope_parameters)
    original = (original_max_position_embeddings or rope.get("original_max_position_embeddings")
                or config.max_position_embeddings)
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": rope["rope_theta"], "factor": float(factor),
                              "original_max_position_embeddings": int(original)}
    config.max_position_embeddings = math.ceil(original * factor)
    decoder = _decoder(model)
    decoder.rotary_emb = type(decoder.rotary_emb)(config).to(next(model.parameters()).device)
    return model


def yarn_bands(config, factor: float) -> dict:
    """Which rotary frequencies YaRN with `factor` over the trained context (`config.max_position_embeddings`) leaves
    alone, divides by `factor` (interpolation) and ramps between, read from Transformers' own YaRN frequencies
    against the plain ones (`theta^(-2i/d)`, i = 0 .. d/2 - 1): `{"unchanged", "ramp", "interpolated"}` (lists of
    i), `rotations` (turns of each frequency within the trained context) and `attention_factor` (YaRN's scale on
    cos and sin, so the attention logits scale by its square)."""
    original, theta = config.max_position_embeddings, config.rope_parameters["rope_theta"]
    yarn = copy.deepcopy(config)
    yarn.rope_parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor),
                            "original_max_position_embeddings": original}
    yarn.max_position_embeddings = math.ceil(original * factor)
    scaled, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](yarn, None)
    dims = config.head_dim
    plain = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    ratio = (scaled.double() / plain).tolist()
    bands = {"unchanged": [], "ramp": [], "interpolated": []}
    for i, r in enumerate(ratio):
        band = "unchanged" if abs(r - 1) < 1e-5 else "interpolated" if abs(r * factor - 1) < 1e-5 else "ramp"
        bands[band].append(i)
    return {**bands, "rotations": (original * plain / (2 * math.pi)).tolist(), "attention_factor": attention_factor}


def perplexity_by_length(model, windows, lengths: list[int], yarn_factor: float | None = None,
                         batch_size: int = 8, recall_targets=None) -> list[dict]:
    """Perplexity of `model` at each context length, without and (if `yarn_factor`) with YaRN.

    `windows(length) -> [N, length]` gives the held-out sequences for a length. Returns one dict per length:
    `{"length", "sequences", "nll", "ppl"}` and, with YaRN, `"nll_yarn"`, `"ppl_yarn"`. With
    `recall_targets(ids) -> [N, length]` bool (the positions that need recall, e.g. `KeyValueRecall.recall_targets`),
    also `"recall"` (and `"recall_yarn"`): `recall_accuracy` there.
    """
    yarn_model = with_yarn(model, yarn_factor) if yarn_factor else None
    rows = []
    for length in lengths:
        ids = windows(length)
        nll = mean_nll(model, ids, batch_size)
        row = {"length": length, "sequences": ids.shape[0], "nll": nll, "ppl": math.exp(nll)}
        if yarn_model is not None:
            row["nll_yarn"] = mean_nll(yarn_model, ids, batch_size)
            row["ppl_yarn"] = math.exp(row["nll_yarn"])
        if recall_targets is not None:
            targets = recall_targets(ids)
            row["recall"] = recall_accuracy(model, ids, targets, batch_size)
            if yarn_model is not None:
                row["recall_yarn"] = recall_accuracy(yarn_model, ids, targets, batch_size)
        rows.append(row)
    return rows
