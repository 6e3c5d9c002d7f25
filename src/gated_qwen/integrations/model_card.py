"""Model cards for the Hugging Face Hub: `gated-qwen card MODEL_DIR` writes MODEL_DIR/README.md.

The card (template: `hub_cards/model_card.md` at the repository root, shipped in the package through the link
`gated_qwen/hub_cards`, rendered by `huggingface_hub.ModelCard`) carries the metadata the Hub reads
(`library_name: transformers`, `pipeline_tag: text-generation`, `license`, `base_model`, `tags` with `gated-attention`
and `custom_code`, and `model-index` when evaluation results are given) and a body that states the gate variant and
the sizes (the experts of a mixture of experts too), how to load the model with and without this package, and the
citation. Nothing a user gives reaches the card's text unchecked: repository ids follow the Hub's rules, the title is
one printable line, the code examples hold the repository id as a Python string literal, table cells are escaped,
and `--eval-results` fields are checked for their types. The card is written through `gated_qwen.files` (a
README.md that is a link is replaced, never written through; a Hugging Face cache snapshot is refused).

Publishing: `model.push_to_hub(repo_id)` uploads the weights, config.json (with `auto_map`) and the code files in
one commit, through `huggingface_hub` (`push_to_hub` below, which the package installs as the models' push). When
the revision it goes to (the branch, or the one a pull request starts from) has no card yet, that commit's README.md
is this package's card, and a card already there is kept with the push's tags added (push one with a licence or
evaluation results first with `model_card(config, ...).push_to_hub(repo_id)`); a folder with its card goes up whole
with `hf upload REPO_ID MODEL_DIR`. With `create_pr=True` or `revision="dev"` nothing reaches `main`. A model loaded
as remote code, without the package, pushes with Transformers' generic card. The `gated-qwen card` command is
defined here too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import unicodedata
from pathlib import Path

import torch
from huggingface_hub import CommitOperationAdd, EvalResult, HfApi, ModelCard, ModelCardData, hf_hub_download
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..files import check_output, config_from_dict, output_file, parse_json, read_json_object
from ..model.configuration_gated import GATED_MODEL_TYPES, GatedQwenConfig
from ..model.configuration_gated_moe import GatedQwenMoeConfig
from ..model.gating import FIELDS, POSITIONS, gate_parameters_per_layer, gated_layers, is_recommended
from ..model.modeling_gated import GatedQwenForCausalLM
from ..model.modeling_gated_moe import GatedQwenMoeForCausalLM

TEMPLATE = Path(__file__).parents[1] / "hub_cards" / "model_card.md"
TAGS = ["gated-attention", "gated_qwen", "custom_code", "text-generation"]

_EVAL_REQUIRED = ["task_type", "dataset_type", "dataset_name", "metric_type", "metric_value"]


class CardError(ValueError):
    """A model folder, a flag or a results file the card cannot be written from; the message says why."""


def describe_gate(config: GatedQwenConfig) -> str:
    """One sentence naming the gate variant in the paper's terms (G1...G5, elementwise/headwise, ...)."""
    if config.gate_position is None:
        control = {
            None: "",
            "rmsnorm": " with the paper's RMSNorm control on each head's attention output",
            "silu": " with the paper's SiLU control on the attention output",
        }[config.sdpa_output_transform]
        return f"No gate: the paper's baseline, a plain Qwen3 attention{control}."
    position = config.gate_position
    granularity = config.gate_granularity if position != "dense" else "elementwise"
    sharing = "head-shared" if config.gate_shared_across_heads else "head-specific"
    if position == "dense":
        sharing = "over the whole hidden state"
    scores = "computed from the hidden state after the pre-attention RMSNorm (the input of q/k/v)"
    if not config.gate_input_dependent:
        scores = "input-independent (a learned, zero-initialised logit per score)"
    combine = "multiplies" if config.gate_combine == "multiply" else "is added to"
    layers = "every layer" if config.gate_layers is None else f"layers {list(config.gate_layers)}"
    return (
        f"{POSITIONS[position].paper} (`gate_position=\"{position}\"`): a `{config.gate_activation}` gate, "
        f"{granularity} and {sharing}, {scores}, that {combine} {POSITIONS[position].description}, in {layers}"
        + (", the paper's recommended form." if is_recommended(config) else ".")
    )


def _gate_fields(config: GatedQwenConfig) -> list[tuple[str, object]]:
    return [(name, getattr(config, name)) for name in FIELDS]


def count_parameters(config: GatedQwenConfig) -> tuple[int, int]:
    """(all parameters, gate parameters) of the causal LM of `config` (`GatedQwenForCausalLM`, or
    `GatedQwenMoeForCausalLM` for a `GatedQwenMoeConfig`), counted on the meta device."""
    with torch.device("meta"):
        model = (GatedQwenMoeForCausalLM if isinstance(config, GatedQwenMoeConfig) else GatedQwenForCausalLM)(config)
    return model.num_parameters(), gate_parameters_per_layer(config) * len(gated_layers(config))


def _field_kind(annotation) -> str:
    """What JSON value an `EvalResult` field takes: "string", "object", "boolean" or "value" (a number or string)."""
    text = str(annotation)
    return ("object" if "dict" in text else "boolean" if "bool" in text else "string" if "str" in text
            else "value")


def _check_eval_value(where: str, name: str, value, required: bool, kind: str) -> None:
    if value is None and not required:
        return
    ok = {"string": isinstance(value, str) and (value.strip() or not required),
          "object": isinstance(value, dict),
          "boolean": isinstance(value, bool),
          "value": isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)
                                              and math.isfinite(value))}[kind]
    if not ok:
        expected = {"string": "a non-empty string" if required else "a string", "object": "a JSON object",
                    "boolean": "true or false", "value": "a finite number or a string"}[kind]
        raise CardError(f"{where}: `{name}` must be {expected}" + ("" if required else " (or null)")
                        + f", not {json.dumps(value)[:60]}.")


def read_eval_results(path: str | os.PathLike) -> list[EvalResult]:
    """Reads a JSON list of results, each an object with `huggingface_hub.EvalResult`'s fields, e.g.
    `{"task_type": "text-generation", "dataset_type": "wikitext", "dataset_name": "WikiText-103",
    "metric_type": "perplexity", "metric_value": 12.3}`, each field checked for its type."""
    kinds = {field.name: _field_kind(field.type) for field in dataclasses.fields(EvalResult) if field.init}
    fields = list(kinds)
    path = Path(path)
    if not path.is_file():
        raise CardError(f"--eval-results {str(path)!r} is not a file; give a JSON file with a list of results.")

    try:
        text = path.read_text()
    except UnicodeDecodeError as error:
        raise CardError(f"--eval-results {str(path)!r} is not valid JSON ({' '.join(str(error).split())}).") from None
    entries = parse_json(text, f"--eval-results {str(path)!r}", CardError)
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise CardError(
            f"--eval-results {str(path)!r} must hold a non-empty JSON list of objects with the fields "
            f"{_EVAL_REQUIRED} (and optionally {[f for f in fields if f not in _EVAL_REQUIRED]})."
        )
    results = []
    for i, entry in enumerate(entries):
        missing = [f for f in _EVAL_REQUIRED if f not in entry]
        unknown = sorted(set(entry) - set(fields))
        if missing or unknown:
            raise CardError(
                f"--eval-results {str(path)!r}, result {i}: "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown field(s) {unknown}" if unknown else "")
                + f". The fields are {fields}; {_EVAL_REQUIRED} are required."
            )
        for name, value in entry.items():
            _check_eval_value(f"--eval-results {str(path)!r}, result {i}", name, value, name in _EVAL_REQUIRED,
                              kinds[name])
        results.append(EvalResult(**entry))
    return results


def model_card(
    config: GatedQwenConfig,
    *,
    model_name: str,
    repo_id: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    eval_results: list[EvalResult] | None = None,
) -> ModelCard:
    """The card of a GatedQwen model with this config (see the module docstring for what it holds). Every value
    pasted into the card's text is checked or quoted: `model_name` is one line of printable text, `repo_id` and
    `base_model` are Hub repository ids (Hugging Face's rules), the code examples hold `repo_id` as a Python string
    literal, and the evaluation table's cells are escaped."""
    model_name = check_model_name(model_name)
    for flag, value in (("--repo-id", repo_id), ("--base-model", base_model)):
        if value is not None:
            check_repo_id(value, flag)
    num_parameters, gate_parameters = count_parameters(config)
    data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        base_model=base_model,
        tags=list(TAGS),
        eval_results=eval_results or None,
    )
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=model_name,
        repo_id_literal=json.dumps(repo_id or model_name),  # a JSON string is a Python string literal
        base_model=base_model,
        config=config,
        gate_description=describe_gate(config),
        gate_fields=_gate_fields(config),
        num_parameters=num_parameters,
        gate_parameters=gate_parameters,
        eval_rows=[[_table_cell(value) for value in (r.task_name or r.task_type, r.dataset_name, r.dataset_split or "",
                                                     r.metric_name or r.metric_type, r.metric_value)]
                   for r in eval_results or []],
    )


def check_repo_id(repo_id: str, flag: str) -> str:
    """`repo_id` when it is a Hub repository id by Hugging Face's rules (`huggingface_hub`'s validator), else a
    `CardError` naming `flag`."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise CardError(f"{flag} {repo_id!r} is not a Hub repository id ({' '.join(str(error).split())}); write "
                        "NAME or ORG/NAME, e.g. my-org/gated-qwen-1b.") from None
    return repo_id


def check_model_name(name: str) -> str:
    """`name` when it is one line of printable text (it becomes the card's title), else a `CardError`."""
    if not name.strip() or any(unicodedata.category(c)[0] == "C" for c in name):
        raise CardError(f"the model name {name!r} (--model-name, default: MODEL_DIR's folder name) must be one line of "
                        "printable text; pass --model-name NAME.")
    return name


def _table_cell(value) -> str:
    """`value` as the text of one Markdown table cell (no line breaks, `|` escaped)."""
    return " ".join(str(value).split()).replace("\\", "\\\\").replace("|", "\\|")


def push_to_hub(model, repo_id: str, *, commit_message: str | None = None, commit_description: str | None = None,
                private: bool | None = None, token: bool | str | None = None, revision: str | None = None,
                create_pr: bool = False, max_shard_size: int | str | None = "50GB",
                tags: list[str] | None = None):
    """`model.push_to_hub(...)` (same arguments as Transformers'): creates the repository if needed, saves the model
    into a temporary folder with its README.md (this package's card where the target revision has none, else the
    card it has, in both cases with the model's and the push's tags) and uploads the folder in one commit to
    `revision` (a branch created from `main` if new) or to a new pull request with `create_pr`. Returns the
    `CommitInfo`."""
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    added = [*(model.model_tags or []), *([tags] if isinstance(tags, str) else tags or [])]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
        if target_has_card(repo_id, revision, token):
            base = revision if revision and api.revision_exists(repo_id, revision) else None
            card = ModelCard.load(hf_hub_download(repo_id, "README.md", revision=base, token=token))
        else:
            card = model_card(model.config, model_name=repo_id.split("/")[-1], repo_id=repo_id)
        card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *added]))
        card.save(Path(folder) / "README.md")
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        files = sorted(path for path in Path(folder).rglob("*") if path.is_file())
        return api.create_commit(
            repo_id, [CommitOperationAdd(path_in_repo=path.relative_to(folder).as_posix(), path_or_fileobj=str(path))
                      for path in files],
            commit_message=commit_message or "Upload model", commit_description=commit_description,
            revision=revision, create_pr=create_pr)


def model_push_to_hub(self, repo_id: str, **kwargs):
    """The models' `push_to_hub` where the gated_qwen package is installed (`gated_qwen.register` attaches it): the
    push of `push_to_hub` above, whose README.md is this package's model card where the revision pushed to has none
    yet; same arguments as Transformers'."""
    return push_to_hub(self, repo_id, **kwargs)


def target_has_card(repo_id: str, revision: str | None = None, token: str | bool | None = None) -> bool:
    """Whether the revision a push to `repo_id` lands on already has a README.md: `revision` (default `main`; a pull
    request starts from it), or `main` when `revision` names a branch that does not exist yet (it is created from
    `main`)."""
    api = HfApi(token=token)
    revision = revision or "main"
    if api.file_exists(repo_id, "README.md", revision=revision):
        return True
    new_branch = revision != "main" and not revision.startswith("refs/") and not api.revision_exists(repo_id, revision)
    return new_branch and api.file_exists(repo_id, "README.md")


def load_model_config(model_dir: str | os.PathLike) -> GatedQwenConfig:
    """The config of a saved GatedQwen folder, dense or mixture of experts (a `GatedQwenMoeConfig`), refusing
    folders that cannot be loaded without this package."""
    model_dir = Path(model_dir)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CardError(f"MODEL_DIR {str(model_dir)!r} has no config.json; give a folder written by save_pretrained.")

    config_dict = read_json_object(config_file, "MODEL_DIR's config.json", CardError)
    if config_dict.get("model_type") not in GATED_MODEL_TYPES:
        raise CardError(
            f"MODEL_DIR {str(model_dir)!r} holds model_type {config_dict.get('model_type')!r}, not "
            f"{' or '.join(repr(t) for t in GATED_MODEL_TYPES)}; convert it first (`gated-qwen convert`)."
        )
    auto_map = config_dict.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise CardError(f"MODEL_DIR {str(model_dir)!r}: config.json's auto_map must be an object of Auto class -> "
                        f"module.Class, not {json.dumps(auto_map)[:40]}.")
    local = {ref.split(".")[0] + ".py" for ref in auto_map.values() if isinstance(ref, str) and "--" not in ref}
    missing = sorted(local - {p.name for p in model_dir.iterdir()})
    if "AutoModelForCausalLM" not in auto_map or missing:
        raise CardError(
            f"MODEL_DIR {str(model_dir)!r} cannot be loaded without this package: "
            + (f"the code file(s) {missing} named by config.json's auto_map are missing" if missing
               else "config.json's auto_map does not name AutoModelForCausalLM")
            + ". Save the model again with `save_pretrained` after `import gated_qwen`, which writes both."
        )
    moe = config_dict["model_type"] == GatedQwenMoeConfig.model_type
    return config_from_dict(GatedQwenMoeConfig if moe else GatedQwenConfig, config_dict,
                            f"the config.json of MODEL_DIR {str(model_dir)!r}", CardError)


def write_card(
    model_dir: str | os.PathLike,
    *,
    base_model: str | None = None,
    license: str | None = None,
    eval_results: str | os.PathLike | None = None,
    model_name: str | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes MODEL_DIR/README.md (whole or not at all, through `gated_qwen.files`); an existing card is replaced
    only with `overwrite`, and never when it is one of the files the card is made from."""
    model_dir = Path(model_dir)
    destination = model_dir / "README.md"
    out = dict(inputs=[model_dir / "config.json", eval_results, *model_dir.glob("*.py")], overwrite=overwrite,
               label="the card")
    if model_dir.is_dir():
        check_output(destination, kind="file", **out)
    config = load_model_config(model_dir)
    results = read_eval_results(eval_results) if eval_results is not None else None
    card = model_card(config, model_name=model_name or model_dir.resolve().name, repo_id=repo_id,
                      base_model=base_model, license=license, eval_results=results)
    with output_file(destination, **out) as path:
        card.save(path)
    return destination


def run(args: argparse.Namespace) -> int:
    path = write_card(args.model_dir, base_model=args.base_model, license=args.license,
                      eval_results=args.eval_results, model_name=args.model_name, repo_id=args.repo_id,
                      overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "card",
        help="Write the Hub model card (README.md) of a saved GatedQwen folder.",
        description="Write MODEL_DIR/README.md: Hub metadata, the gate variant and sizes, how to load, the citation.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a folder written by save_pretrained")
    parser.add_argument("--base-model", default=None, metavar="REPO_ID", help="the model this one comes from")
    parser.add_argument("--license", default=None, metavar="ID", help="a Hub licence identifier, e.g. apache-2.0")
    parser.add_argument("--eval-results", default=None, metavar="FILE",
                        help="JSON list of results with huggingface_hub.EvalResult's fields (task_type, "
                             "dataset_type, dataset_name, metric_type, metric_value, ...); adds model-index")
    parser.add_argument("--model-name", default=None, help="the card's title (default: the folder's name)")
    parser.add_argument("--repo-id", default=None, help="the Hub repository named in the loading examples "
                                                        "(default: the model name)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing README.md")
    parser.set_defaults(func=run)
