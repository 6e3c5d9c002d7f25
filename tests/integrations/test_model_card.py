"""The Hub: `gated-qwen card` (metadata and body, read back with `huggingface_hub.ModelCard.load`), `push_to_hub`
end to end against a fake Hub served through huggingface_hub's HTTP client factory, the pushed folder loading in a
fresh process where `gated_qwen` cannot be imported, and a push in offline mode failing clearly."""

import base64
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import httpx2
import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard, constants
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils._http import default_client_factory
from safetensors import safe_open
from transformers import Qwen3Config, Qwen3ForCausalLM

import gated_qwen.model.modeling_gated
from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.cli import main as cli
from gated_qwen.integrations.model_card import describe_gate, model_card
from gated_qwen.model.gating import gate_parameters_per_layer, gated_layers
from tests.helpers import TINY, assert_refused, bare_environment

RESULTS = [{"task_type": "text-generation", "dataset_type": "wikitext", "dataset_name": "WikiText-103",
            "dataset_split": "test", "metric_type": "perplexity", "metric_value": 12.5}]


def saved_model(folder: Path, **gate) -> GatedQwenForCausalLM:
    torch.manual_seed(0)
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY, **gate))
    model.save_pretrained(folder)
    return model


def weights_in(folder: Path) -> int:
    """Number of stored weights, read from the safetensors headers."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                total += torch.Size(f.get_slice(key).get_shape()).numel()
    return total


# ------------------------------------------------------------------------------------------------------------ card
def test_card_metadata_and_body(tmp_path):
    folder = tmp_path / "tiny-gated"
    saved_model(folder)
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    assert cli(["card", str(folder), "--base-model", "Qwen/Qwen3-1.7B", "--license", "apache-2.0",
                "--eval-results", str(results), "--repo-id", "me/tiny-gated"]) == 0

    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert card.data.base_model == "Qwen/Qwen3-1.7B"
    assert {"gated-attention", "custom_code"} <= set(card.data.tags)
    assert "model-index:" in card.content
    (result,) = card.data.eval_results
    assert (result.dataset_name, result.dataset_split, result.metric_type, result.metric_value) == (
        "WikiText-103", "test", "perplexity", 12.5)

    body = card.text
    assert "G1" in body and "elementwise and head-specific" in body and "recommended form" in body
    gate = TINY["hidden_size"] * TINY["num_attention_heads"] * TINY["head_dim"] * TINY["num_hidden_layers"]
    assert f"{weights_in(folder):,} (gate: {gate:,})" in body  # tied embeddings are stored and counted once
    assert "| layers | 2 |" in body and "| query / key-value heads, head dim | 4 / 2, 8 |" in body
    assert 'from_pretrained("me/tiny-gated", trust_remote_code=True)' in body  # without the package
    assert "import gated_qwen" in body and 'from_pretrained("me/tiny-gated")\n' in body  # with it
    assert "arXiv:2505.06708" in body and re.search(r"@article\{qiu2025gated,\n\s+title", body)
    assert "| text-generation | WikiText-103 | test | perplexity | 12.5 |" in body


@pytest.mark.parametrize(
    "gate, says",
    [
        ({"gate_position": "value", "gate_granularity": "headwise", "gate_layers": [1]},
         ["G2 (`gate_position=\"value\"`)", "headwise and head-specific", "`v_proj`", "in layers [1]"]),
        ({"gate_position": "dense"}, ["G5", "over the whole hidden state", "output of `o_proj`"]),
        ({"gate_position": None}, ["No gate: the paper's baseline"]),
    ],
)
def test_card_names_the_gate_variant_without_optional_metadata(tmp_path, gate, says):
    model = saved_model(tmp_path, **gate)
    assert cli(["card", str(tmp_path), "--model-name", "Tiny Gated"]) == 0
    card = ModelCard.load(tmp_path / "README.md")
    assert card.text.lstrip().startswith("# Tiny Gated\n")
    assert 'from_pretrained("Tiny Gated", trust_remote_code=True)' in card.text  # --repo-id defaults to the name
    for phrase in says:
        assert phrase in card.text
    assert "recommended form" not in card.text
    expected_gate = gate_parameters_per_layer(model.config) * len(gated_layers(model.config))
    assert f"{weights_in(tmp_path):,} (gate: {expected_gate:,})" in card.text
    assert card.data.license is None and card.data.base_model is None and "model-index" not in card.content


# The paper's recommended gate (section 1): G1 (the SDPA output), elementwise, head-specific, multiplicative, sigmoid,
# of X W with X the normed input of q/k/v (input-dependent) and W a bias-free linear map.
RECOMMENDED = dict(gate_position="sdpa", gate_granularity="elementwise", gate_shared_across_heads=False,
                   gate_combine="multiply", gate_activation="sigmoid", gate_input_dependent=True, gate_bias=False)


@pytest.mark.parametrize("change, recommended", [
    ({}, True),
    *[({"gate_position": position}, False) for position in ("value", "key", "query", "dense", None)],
    ({"gate_position": "G1"}, True),  # the paper's name of "sdpa"
    ({"gate_granularity": "headwise"}, False),
    ({"gate_shared_across_heads": True}, False),
    ({"gate_combine": "add"}, False),
    *[({"gate_activation": activation}, False) for activation in ("silu", "ns_sigmoid", "identity")],
    ({"gate_input_dependent": False}, False),
    ({"gate_bias": True}, False),
    # where the gate sits and the rest of the model are not the gate's form (the sentence names the layers)
    ({"gate_layers": [1]}, True),
    ({"attention_bias": True, "num_key_value_heads": 4, "use_qk_norm": False}, True),
], ids=lambda value: json.dumps(value) if isinstance(value, dict) else str(value))
def test_recommended_form_note_holds_exactly_for_the_papers_recommended_gate(change, recommended):
    """Each gate field changed alone from the paper's recommended gate turns the card's note off."""
    sentence = describe_gate(GatedQwenConfig(**{**TINY, **RECOMMENDED, **change}))
    assert ("the paper's recommended form" in sentence) == recommended, sentence


def test_card_of_a_mixture_of_experts_states_its_experts(tmp_path):
    from gated_qwen import GatedQwenMoeConfig, GatedQwenMoeForCausalLM
    from tests.helpers import TINY_MOE

    torch.manual_seed(0)
    config = GatedQwenMoeConfig(**TINY, **TINY_MOE, mlp_only_layers=[0], shared_expert_intermediate_size=24)
    GatedQwenMoeForCausalLM(config).save_pretrained(tmp_path)
    assert cli(["card", str(tmp_path), "--repo-id", "me/tiny-moe"]) == 0
    body = ModelCard.load(tmp_path / "README.md").text
    gate = TINY["hidden_size"] * TINY["num_attention_heads"] * TINY["head_dim"] * TINY["num_hidden_layers"]
    assert f"{weights_in(tmp_path):,} (gate: {gate:,})" in body  # the experts counted, as stored one by one
    assert "| experts | 8 of width 32, top-2 per token, in layers [1], with a shared expert of width 24 |" in body
    assert "mixture of experts" in body and 'model_type="gated_qwen_moe"' in body and "modeling_gated_moe.py" in body


def test_card_refuses_to_overwrite_and_replaces_with_overwrite(tmp_path, capsys):
    saved_model(tmp_path)
    (tmp_path / "README.md").write_text("my own card\n")
    assert cli(["card", str(tmp_path)]) == 2
    assert "README.md' already exists; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "README.md").read_text() == "my own card\n"
    assert cli(["card", str(tmp_path), "--overwrite"]) == 0
    assert ModelCard.load(tmp_path / "README.md").data.library_name == "transformers"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


BAD_RESULTS = {
    "bad_json": "[{",
    "not_a_list": {"metric_value": 1},
    "missing_field": [{k: v for k, v in RESULTS[0].items() if k != "metric_value"}],
    "unknown_field": [{**RESULTS[0], "score": 3}],
    "number_as_task": [{**RESULTS[0], "task_type": 5}],
    "null_value": [{**RESULTS[0], "metric_value": None}],
    "list_value": [{**RESULTS[0], "metric_value": [1, 2]}],
    "nan_value": "[" + json.dumps({**RESULTS[0], "metric_value": 0}).replace("0}", "NaN}") + "]",
    "verified_as_text": [{**RESULTS[0], "verified": "yes"}],
    "args_as_text": [{**RESULTS[0], "dataset_args": "x"}],
    "empty_name": [{**RESULTS[0], "dataset_name": " "}],
}


@pytest.mark.parametrize(
    "damage, message",
    [
        ("no_config", "has no config.json"),
        ("qwen3", "holds model_type 'qwen3', not 'gated_qwen'"),
        ("no_code", "the code file(s) ['modeling_gated.py'] named by config.json's auto_map are missing"),
        ("bad_json", "is not valid JSON"),
        ("not_a_list", "must hold a non-empty JSON list of objects"),
        ("missing_field", "missing ['metric_value']"),
        ("unknown_field", "unknown field(s) ['score']"),
        ("number_as_task", "result 0: `task_type` must be a non-empty string, not 5."),
        ("null_value", "result 0: `metric_value` must be a finite number or a string, not null."),
        ("list_value", "result 0: `metric_value` must be a finite number or a string, not [1, 2]."),
        ("nan_value", "result 0: `metric_value` must be a finite number or a string, not NaN."),
        ("verified_as_text", "result 0: `verified` must be true or false (or null), not \"yes\"."),
        ("args_as_text", "result 0: `dataset_args` must be a JSON object (or null), not \"x\"."),
        ("empty_name", "result 0: `dataset_name` must be a non-empty string, not \" \"."),
    ],
)
def test_card_bad_input_gets_a_clear_error(tmp_path, capsys, damage, message):
    folder = tmp_path / "model"
    if damage == "no_config":
        folder.mkdir()
    elif damage == "qwen3":
        Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(folder)
    else:
        saved_model(folder)
    if damage == "no_code":
        (folder / "modeling_gated.py").unlink()
    extra = []
    if damage in BAD_RESULTS:
        results = tmp_path / "results.json"
        content = BAD_RESULTS[damage]
        results.write_text(content if isinstance(content, str) else json.dumps(content))
        extra = ["--eval-results", str(results)]
    assert_refused(capsys, ["card", str(folder), *extra], message)
    assert not (folder / "README.md").exists()


INJECTION = 'x", trust_remote_code=True); __import__("os").system("touch PWNED"); ("x'


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_the_cards_code_holds_every_value_as_a_literal(tmp_path):
    """A folder name with a quote and a call in it stays a string in the card's Python: each block parses, calls
    nothing but from_pretrained, and hands it the name as one string constant."""
    import ast

    folder = tmp_path / INJECTION
    saved_model(folder)
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{**RESULTS[0], "dataset_name": "Wiki|Text\n| injected | row |"}]))
    assert cli(["card", str(folder), "--eval-results", str(results)]) == 0
    card = ModelCard.load(folder / "README.md")
    blocks = python_blocks(card.text)
    assert len(blocks) == 2
    for block in blocks:
        calls = [node for node in ast.walk(ast.parse(block)) if isinstance(node, ast.Call)]
        assert [call.func.attr for call in calls] == ["from_pretrained"]
        assert isinstance(calls[0].args[0], ast.Constant) and calls[0].args[0].value == INJECTION
    (row,) = [line for line in card.text.splitlines() if "Wiki" in line]
    assert len(re.findall(r"(?<!\\)\|", row)) == 6 and "injected" in row  # five cells, the name in one of them
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("args, message", [
    (["--repo-id", 'me/x"); import os; ("'], "--repo-id 'me/x\"); import os; (\"' is not a Hub repository id"),
    (["--repo-id", "a/b/c"], "--repo-id 'a/b/c' is not a Hub repository id"),
    (["--base-model", "Qwen/Qwen3 1.7B"], "--base-model 'Qwen/Qwen3 1.7B' is not a Hub repository id"),
    (["--model-name", "title\n```python\nimport os"], "must be one line of printable text"),
])
def test_card_values_are_checked_by_the_hubs_rules(tmp_path, capsys, args, message):
    saved_model(tmp_path / "model")
    assert_refused(capsys, ["card", str(tmp_path / "model"), *args], message)
    assert not (tmp_path / "model" / "README.md").exists()


# ----------------------------------------------------------------------------------------------------- push_to_hub
class FakeHub:
    """The Hub endpoints `push_to_hub` and `ModelCard.push_to_hub` use, answered from memory: every repository has
    refs (`main`, branches, `refs/pr/N`), each a dict path -> content (`refs[repo][ref]`). Branches start as a copy
    of `main`; a commit with `create_pr=1` opens a pull request: a new ref with the files of the revision it starts
    from plus the commit's. Every commit gets a new id, as on the Hub: huggingface_hub's download cache is keyed by
    commit, so one id for every answer would serve a file cached from an earlier commit."""

    def __init__(self):
        self.refs: dict[str, dict[str, dict[str, bytes]]] = {}
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo, ref, paths), in order
        self.heads: dict[tuple[str, str], str] = {}

    def files(self, repo: str, ref: str = "main") -> dict[str, bytes]:
        return self.refs[repo][ref]

    @staticmethod
    def _split(raw_path: str, marker: str) -> tuple[str, str, str]:
        """`/api/models/me/repo/commit/refs%2Fpr%2F1` -> ("me/repo", "refs/pr/1", rest after the revision)."""
        repo, rest = raw_path.strip("/").removeprefix("api/models/").split(f"/{marker}/", 1)
        revision, _, tail = rest.partition("/")
        return repo, unquote(revision), unquote(tail)

    def __call__(self, request: httpx2.Request) -> httpx2.Response:
        path, raw, method = request.url.path, request.url.raw_path.decode().split("?")[0], request.method
        if method == "POST" and path == "/api/repos/create":
            body = json.loads(request.content)
            repo = f"{body['organization']}/{body['name']}" if body.get("organization") else body["name"]
            self.refs.setdefault(repo, {"main": {}})
            return httpx2.Response(200, json={"url": f"https://huggingface.co/{repo}"})
        if "/resolve/" in raw:
            repo, revision, file = self._split(raw, "resolve")
            files = self.refs.get(repo, {}).get(revision)
            if files is None:
                return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound"})
            if file not in files:
                return httpx2.Response(404, headers={"X-Error-Code": "EntryNotFound"})
            headers = {"ETag": f'"{hashlib.sha256(files[file]).hexdigest()}"',
                       "X-Repo-Commit": self.heads.get((repo, revision), "0" * 40)}
            return httpx2.Response(200, content=files[file], headers=headers)
        if method == "GET" and "/revision/" in raw:  # repo_info, for revision_exists
            repo, revision, _ = self._split(raw, "revision")
            if revision not in self.refs.get(repo, {}):
                return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound"})
            return httpx2.Response(200, json={"id": repo, "sha": self.heads.get((repo, revision), "0" * 40)})
        if method == "POST" and path == "/api/validate-yaml":
            return httpx2.Response(200, json={})
        if method == "POST" and "/preupload/" in raw:
            files = json.loads(request.content)["files"]
            return httpx2.Response(200, json={"files": [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        if method == "POST" and "/branch/" in raw:
            repo, branch, _ = self._split(raw, "branch")
            if branch in self.refs[repo]:
                return httpx2.Response(409, json={"error": "Reference already exists"})
            start = (json.loads(request.content or b"{}") or {}).get("startingPoint", "main")
            self.refs[repo][branch] = dict(self.refs[repo][start])
            return httpx2.Response(200, json={})
        if method == "POST" and "/commit/" in raw:
            repo, revision, _ = self._split(raw, "commit")
            if repo not in self.refs:
                return httpx2.Response(404, headers={"X-Error-Code": "RepoNotFound"})
            if revision not in self.refs[repo]:
                return httpx2.Response(404, headers={"X-Error-Code": "RevisionNotFound"})
            files = [json.loads(line)["value"] for line in request.content.decode().splitlines()]
            files = [f for f in files if "content" in f]
            pr_url = None
            if request.url.params.get("create_pr") == "1":
                number = sum(ref.startswith("refs/pr/") for ref in self.refs[repo]) + 1
                self.refs[repo][f"refs/pr/{number}"] = dict(self.refs[repo][revision])
                revision, pr_url = f"refs/pr/{number}", f"https://huggingface.co/{repo}/discussions/{number}"
            for f in files:
                self.refs[repo][revision][f["path"]] = base64.b64decode(f["content"])
            self.commits.append((repo, revision, sorted(f["path"] for f in files)))
            oid = hashlib.sha1(f"{repo} {len(self.commits)}".encode()).hexdigest()
            self.heads[(repo, revision)] = oid
            return httpx2.Response(200, json={"commitUrl": f"https://huggingface.co/{repo}/commit/{oid}",
                                              "commitOid": oid, "pullRequestUrl": pr_url})
        return httpx2.Response(404, json={"error": f"the fake Hub does not serve {method} {path}"})


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(hub)))
    yield hub
    huggingface_hub.set_client_factory(default_client_factory)


def code_files() -> set[str]:
    """The modeling file and every module it reaches through relative imports (the backend adapter, the kernel)."""
    package = Path(gated_qwen.model.modeling_gated.__file__).parent
    found, todo = set(), ["modeling_gated.py"]
    while todo:
        name = todo.pop()
        found.add(name)
        source = (package / name).read_text()
        relative = re.findall(r"^\s*from \.(\w+) import", source, flags=re.MULTILINE)
        todo += [f"{module}.py" for module in relative if f"{module}.py" not in found]
    return found


FRESH_PROCESS = """
import sys
sys.modules["gated_qwen"] = None  # `import gated_qwen` fails: only the pushed code files can define the model
import torch
from transformers import AutoModelForCausalLM

folder, ids_file, out_file = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.load(ids_file)).logits, out_file)
"""


@pytest.mark.slow  # a fresh interpreter or several processes
def test_push_to_hub_uploads_a_folder_that_loads_without_the_package(fake_hub, tmp_path):
    torch.manual_seed(0)
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY))
    model.push_to_hub("me/tiny-gated", token="hf_fake")
    repo = fake_hub.files("me/tiny-gated")
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md"} | code_files() <= set(repo)
    assert "configuration_gated.py" in repo
    auto_map = json.loads(repo["config.json"])["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == "modeling_gated.GatedQwenForCausalLM"
    assert {"AutoConfig", "AutoModel", "AutoModelForSequenceClassification"} <= set(auto_map)
    first_card = ModelCard(repo["README.md"].decode())  # a new repository gets this package's card
    assert first_card.data.library_name == "transformers" and first_card.data.pipeline_tag == "text-generation"
    assert {"gated-attention", "custom_code"} <= set(first_card.data.tags)
    assert "## Gate" in first_card.text and describe_gate(model.config) in first_card.text
    (commit,) = fake_hub.commits  # the card travels in the model's own commit
    assert commit[:2] == ("me/tiny-gated", "main") and {"README.md", "model.safetensors"} <= set(commit[2])

    # Our card pushed to the repo is kept by the next push_to_hub (Transformers loads the card already there).
    model_card(model.config, model_name="tiny-gated", repo_id="me/tiny-gated", license="mit").push_to_hub(
        "me/tiny-gated", token="hf_fake")
    model.push_to_hub("me/tiny-gated", token="hf_fake")
    assert len(fake_hub.commits) == 3 and "model.safetensors" in fake_hub.commits[-1][2]
    card = ModelCard(repo["README.md"].decode())
    assert card.data.license == "mit" and "gated-attention" in card.data.tags and "## Gate" in card.text

    pushed = tmp_path / "pushed"
    pushed.mkdir()
    for name, content in repo.items():
        (pushed / name).write_bytes(content)
    ids = torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = bare_environment(tmp_path / "hf_home")
    result = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, str(pushed), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "out.pt"), model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("push", [dict(create_pr=True), dict(revision="dev"), dict(revision="dev", create_pr=True)],
                         ids=["pull request", "branch", "pull request to a branch"])
def test_a_push_to_a_branch_or_pull_request_leaves_main_alone(fake_hub, push):
    """The card travels in the model's own commit, to the same branch or pull request; `main` gets nothing."""
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY))
    model.push_to_hub("me/tiny-gated", token="hf_fake", tags=["my-tag"], **push)
    (repo, ref, paths), = fake_hub.commits
    assert ref == ("refs/pr/1" if push.get("create_pr") else "dev")
    assert {"README.md", "config.json", "model.safetensors"} <= set(paths)
    assert fake_hub.files("me/tiny-gated") == {}  # main: untouched
    card = ModelCard(fake_hub.files("me/tiny-gated", ref)["README.md"].decode())
    assert "## Gate" in card.text and describe_gate(model.config) in card.text
    assert {"gated-attention", "custom_code", "my-tag"} <= set(card.data.tags)


def test_a_push_keeps_the_card_its_revision_already_has(fake_hub):
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY))
    huggingface_hub.HfApi(token="hf_fake").create_repo("me/tiny-gated")
    ModelCard("---\nlicense: mit\n---\n# Written by hand\n").push_to_hub("me/tiny-gated", token="hf_fake")
    model.push_to_hub("me/tiny-gated", token="hf_fake", revision="dev")  # a new branch starts from main's card
    dev_card = ModelCard(fake_hub.files("me/tiny-gated", "dev")["README.md"].decode())
    assert "# Written by hand" in dev_card.text and "## Gate" not in dev_card.text
    assert dev_card.data.license == "mit"


def test_push_in_offline_mode_fails_clearly(monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets when the library loads
    huggingface_hub.set_client_factory(default_client_factory)
    model = GatedQwenForCausalLM(GatedQwenConfig(**TINY))
    with pytest.raises(OfflineModeIsEnabled, match="offline mode is enabled.*HF_HUB_OFFLINE"):
        model.push_to_hub("me/tiny-gated", token="hf_fake")
