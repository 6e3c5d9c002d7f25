"""What `gated-qwen analyze` and `eval-ppl` read: the model folder (`load_model`) and the held-out token windows
(`Inputs`: a text file, a safetensors file of `input_ids`, or the built-in corpus). Bad input raises `ValueError`
with the reason, which the `gated-qwen` command prints as one line (exit status 2)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from .. import GatedQwenForCausalLM, GatedQwenMoeForCausalLM
from ..conversion.io import unpickling_reason
from ..conversion.loading import gated_config_dict
from ..files import CONFIG_VALUE_ERRORS, check_safetensors_files, config_from_dict, read_json_object
from ..files.identity import resolved
from ..files.reading import utf8_named
from ..model.configuration_gated import GATED_MODEL_TYPES
from .footprint import check_model_fits
from .miniature.corpora import CORPORA, HELDOUT_SEED


class Inputs:
    """Held-out token windows for a model: from a text file (the model folder's tokenizer), a safetensors file of
    `input_ids` `[N, S]`, or, by default, the built-in synthetic corpus (for models trained on it by
    `reproduce`). Every window starts the way training sequences did: with BOS where there is one."""

    def __init__(self, model_path: str, vocab_size: int, text: str | None, tokens: str | None):
        self.vocab_size = vocab_size
        self.stream = self.rows = None
        for option, path in (("--text", text), ("--tokens", tokens)):
            if path and not Path(path).is_file():
                raise ValueError(f"{option} {path!r} is not a file.")
        if text:
            try:
                with utf8_named(model_path) as named:  # a name the tokenizers library can open
                    tokenizer = AutoTokenizer.from_pretrained(named)
            except Exception as error:  # noqa: BLE001 (its only input is MODEL's tokenizer files, of any shape: the
                # tokenizers library raises a bare Exception for a model it rejects, Transformers whatever a value of
                # the wrong type meets)
                reason = " ".join(str(error).split())[:300] or type(error).__name__
                raise ValueError(f"--text needs a tokenizer in MODEL {model_path!r}, and none loads ({reason}). Pass "
                                 "--tokens FILE (a safetensors file holding `input_ids` [N, S]) instead.") from None
            try:
                content = Path(text).read_text()
            except UnicodeDecodeError as error:
                raise ValueError(f"--text {text!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from None
            self.stream = tokenizer(content, add_special_tokens=False)["input_ids"]
            self.bos = tokenizer.bos_token_id
            self.description = f"{text} ({len(self.stream)} tokens, {type(tokenizer).__name__})"
        elif tokens:
            try:
                tensors = load_file(tokens)
            except SafetensorError as error:
                raise ValueError(f"--tokens {tokens!r} is not a safetensors file ({' '.join(str(error).split())}); "
                                 "give a safetensors file holding `input_ids` [N, S].") from None
            ids = tensors.get("input_ids")
            if ids is None or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"--tokens {tokens!r} must hold a 2-D integer tensor `input_ids` [N, S]; it holds "
                                 f"{ {k: f'{tuple(v.shape)} {v.dtype}' for k, v in tensors.items()} }.")
            if ids.numel() == 0:
                raise ValueError(f"--tokens {tokens!r} holds no tokens (`input_ids` is {tuple(ids.shape)}); give at "
                                 "least one sequence.")
            self.rows = ids.long()
            self.description = f"{tokens} ({self.rows.shape[0]} x {self.rows.shape[1]} tokens)"
        else:
            language = next((corpus() for corpus in CORPORA.values() if corpus().vocab_size == vocab_size), None)
            if language is None:
                raise ValueError(
                    f"Without --text or --tokens the input is a built-in synthetic corpus, whose vocabularies "
                    f"({', '.join(f'{name}: {corpus().vocab_size}' for name, corpus in CORPORA.items())} ids) do "
                    f"not match MODEL's {vocab_size}. Pass --text FILE (tokenized with MODEL's tokenizer) or "
                    "--tokens FILE.")
            self.language = language
            self.description = f"built-in synthetic corpus {type(language).__name__}, held-out documents"

    def windows(self, length: int, count: int) -> torch.Tensor:
        """`[n, length]` with n <= `count` windows (fewer only when a text is too short for `count`)."""
        if self.stream is not None:
            body = length - (self.bos is not None)
            n = min(count, len(self.stream) // body)
            if n == 0:
                raise ValueError(f"The text has {len(self.stream)} tokens: too few for one window of {length}.")
            ids = torch.tensor(self.stream[: n * body]).view(n, body)
            if self.bos is not None:
                ids = torch.cat([torch.full((n, 1), self.bos), ids], dim=1)
        elif self.rows is not None:
            if self.rows.shape[1] < length:
                raise ValueError(f"--tokens holds sequences of {self.rows.shape[1]} tokens, shorter than the length "
                                 f"{length} asked for.")
            ids = self.rows[:count, :length]
        else:
            ids = self.language.sample(count, length, seed=HELDOUT_SEED)
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"The input holds token ids outside MODEL's vocabulary [0, {self.vocab_size}).")
        return ids


def load_model(path: str, dtype: str, device: str):
    """A gated_qwen or gated_qwen_moe folder, or one `from_pretrained` reads directly (the paper's release, stock
    Qwen3 / Qwen3-MoE, Qwen3.5 / Qwen3-Next; other model types are refused with the reason), with the causal LM of
    its kind: `GatedQwenForCausalLM`, or `GatedQwenMoeForCausalLM` for a mixture of experts."""
    resolved(Path(path), f"MODEL {path!r}", ValueError)
    resolved(Path(path) / "config.json", f"MODEL {path!r}: config.json", ValueError)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"MODEL {path!r} is not a model folder (no config.json); pass a folder written by "
                         "save_pretrained.")
    what = f"the config.json of MODEL {path!r}"
    config_dict = read_json_object(Path(path) / "config.json", what)
    check_safetensors_files(Path(path), f"MODEL {path!r}")
    try:
        if config_dict.get("model_type") not in GATED_MODEL_TYPES:  # another format: its GatedQwen config
            config_dict = gated_config_dict(config_dict, {})
        moe = config_dict["model_type"] == GatedQwenMoeForCausalLM.config_class.model_type
        causal_lm = GatedQwenMoeForCausalLM if moe else GatedQwenForCausalLM
    except CONFIG_VALUE_ERRORS as error:
        raise ValueError(f"MODEL {path!r}: config.json is not a valid config ({' '.join(str(error).split())}).") from None
    config = config_from_dict(causal_lm.config_class, config_dict, what)  # refused before loading
    check_model_fits(causal_lm, config, getattr(torch, dtype), device, what)
    try:
        with utf8_named(path) as named:  # a name safetensors can open
            model = causal_lm.from_pretrained(named, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                              return_dict=True)  # outputs as measure reads them, whatever config.json says
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"MODEL {path!r} holds pickled weights that torch.load(weights_only=True) refuses ("
            f"{unpickling_reason(error)}); only plain tensors are read from pickled files. Save the weights as "
            "safetensors from a source you trust.") from None
    return model.to(device).eval()


def device(name: str) -> str:
    """`--device`: `auto` (CUDA when available, else the CPU) or a device this PyTorch has here, checked before any
    work (a `ValueError` naming what would be right)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {name!r} is not a device; give cpu, cuda, cuda:N or auto (CUDA when "
                         "available).") from None
    if device.type == "meta":
        raise ValueError(f"--device {name!r} holds no data (a meta tensor has a shape, not values), so nothing can be "
                         "measured on it; give cpu, cuda or auto.")
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {name!r}: no {device.type.upper()} device is available here (this PyTorch, "
                         f"{torch.__version__}, sees none); give --device cpu or auto.")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name!r}: this machine has {count} {device.type.upper()} device(s), numbered from "
                         f"0; give one of {', '.join(f'{device.type}:{i}' for i in range(count))}.")
    return name

