"""The Hub kernel (`make kernel-repo`, integrations/kernel_hub.py): a repository generated from src/gated_qwen/kernel/
in the layout Hugging Face's `kernels` loads, and a saved folder's own code that uses it where the package is not
installed.

- The repository is generated, never edited: two builds are byte-identical, every kernel file is its source's bytes,
  and `kernels.get_local_kernel` loads it as its own module (the metadata id), with its own custom ops.
- Its `gated_attention` under the Triton interpreter equals the package's `naive_gated_attention` (fp64): output and
  every gradient, with GQA, elementwise and headwise gates, packed varlen and decode.
- A saved folder whose config.json names the Hub kernel, loaded with `trust_remote_code=True` in a fresh interpreter
  where the gated_qwen package is unimportable: on a CPU it runs SDPA + the gate and loads no kernel; with CUDA faked
  at the device query only (`torch.cuda.is_available`), it loads the kernel at the commit config.json pins, through
  Transformers' own route for Hub attention kernels where the installed Transformers has one (5.25 with kernels
  0.19), else with `kernels.get_kernel` (5.17, 5.19), each through `kernels`' own override of a Hub repository by a local folder (`LOCAL_KERNELS=owner/name=PATH`: nothing else of the download
  is replaced), registers the kernel's attention function as its default attention, and each layer launches the
  Hub module's kernel (real, in the interpreter), giving the package's SDPA logits; without `kernels`, or when the
  kernel does not load, SDPA + the gate with one line naming what would give the fused kernel.
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("kernels", reason="needs the kernels extra: pip install 'gated-qwen[kernels]'")
pytest.importorskip("triton", reason="needs the triton extra: pip install 'gated-qwen[triton]'")

import kernels

from gated_qwen import GatedQwenConfig, GatedQwenForCausalLM
from gated_qwen.integrations import kernel_hub
from gated_qwen.kernel import naive_gated_attention, triton_available
from gated_qwen.model.transformers_compat import hub_attention_kernel_loader
from tests.helpers import SMALL, randomize_

if not triton_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET was not set before import", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5  # fp32 against the fp64 reference, as tests/kernel/test_triton_kernel.py
REPO_ID = "gated-qwen-test/gated-qwen-kernel"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tree(folder: Path) -> dict[str, bytes]:
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


@pytest.fixture(scope="module")
def kernel_repo(tmp_path_factory) -> Path:
    return kernel_hub.write_kernel_repo(tmp_path_factory.mktemp("hub") / "kernel-repo")


@pytest.fixture(scope="module")
def hub(kernel_repo):
    """The Hub kernel's module, as `kernels` loads it from the local repository."""
    return kernels.get_local_kernel(kernel_repo)


def test_the_repository_is_generated_from_the_kernel_and_reproducible(tmp_path, kernel_repo):
    """`python -m gated_qwen.integrations.kernel_hub OUT` (what `make kernel-repo` runs) twice: the same bytes; the
    kernel's files are src/gated_qwen/kernel/'s, in the layout kernels reads; an existing folder is replaced only with
    --overwrite (else exit 2 and one line)."""
    runs = []
    for name in ("a", "b"):
        result = subprocess.run([sys.executable, "-m", "gated_qwen.integrations.kernel_hub", str(tmp_path / name)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        runs.append(tree(tmp_path / name))
    assert runs[0] == runs[1] == tree(kernel_repo)
    package = f"build/torch-universal/{kernel_hub.PACKAGE}/"
    sources = {path.name: path.read_bytes() for path in kernel_hub.KERNEL_SOURCE.glob("*.py")}
    assert {name.removeprefix(package): data for name, data in runs[0].items() if name.startswith(package)} == sources
    assert set(runs[0]) - {package + name for name in sources} == {"README.md", "build/torch-universal/metadata.json"}
    metadata = json.loads(runs[0]["build/torch-universal/metadata.json"])
    assert metadata == kernel_hub.metadata(kernel_hub.source_digest(sources))
    assert kernels.Metadata.read_from_file(kernel_repo / "build/torch-universal/metadata.json").name.python_name == (
        kernel_hub.PACKAGE)

    again = subprocess.run([sys.executable, "-m", "gated_qwen.integrations.kernel_hub", str(tmp_path / "a")],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists" in again.stderr, again.stderr
    replaced = subprocess.run([sys.executable, "-m", "gated_qwen.integrations.kernel_hub", str(tmp_path / "a"),
                               "--overwrite"], capture_output=True, text=True, timeout=300)
    assert replaced.returncode == 0 and tree(tmp_path / "a") == runs[0]


def test_the_repository_replaces_only_a_folder_it_wrote(tmp_path, capsys):
    """What `make kernel-repo` runs (`OUT --overwrite`) writes a new folder and replaces a build of its own (with the
    `__pycache__` an import leaves); a link to a user's folder (a clone of the published repository, `.git`
    included), a folder holding anything a build does not write, or one whose metadata names another kernel is
    refused in one line and left as it was; a parent that is a regular file is named as a file."""
    import shutil

    def run(out) -> tuple[int, str]:
        capsys.readouterr()
        code = kernel_hub.main([str(out), "--overwrite"])
        return code, capsys.readouterr().err

    out = tmp_path / "build" / "kernel-repo"
    assert run(out)[0] == 0
    built = tree(out)
    (out / f"build/torch-universal/{kernel_hub.PACKAGE}/__pycache__").mkdir()
    (out / f"build/torch-universal/{kernel_hub.PACKAGE}/__pycache__/attention.cpython-311.pyc").write_bytes(b"pyc")
    (out / "README.md").write_text("an older build")
    assert run(out)[0] == 0 and tree(out) == built

    clone = tmp_path / "clone"
    shutil.copytree(out, clone)
    (clone / ".git").mkdir()
    (clone / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    link = tmp_path / "linked"
    link.symlink_to(clone)
    other = tmp_path / "other"
    shutil.copytree(out, other)
    (other / "build/torch-universal/metadata.json").write_text('{"name": "someone-elses-kernel"}')
    for target, message in ((link, f"OUT {str(link)!r} is a link (to {str(clone)!r})"),
                            (clone, f"OUT {str(clone)!r} holds '.git', which the kernel repository's build does not "
                                    "write"),
                            (other, f"OUT {str(other)!r} is not a build of gated-qwen-kernel")):
        before = tree(target.resolve())
        code, err = run(target)
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert tree(target.resolve()) == before and link.is_symlink()

    (tmp_path / "a-file").write_text("not a folder")
    code, err = run(tmp_path / "a-file" / "kernel-repo")
    assert code == 2 and err.count("\n") == 1, err
    assert f"{str(tmp_path / 'a-file')!r}, which would hold OUT" in err and "is a file, not a folder" in err, err


@pytest.mark.parametrize("route", ["transformers", "kernels"])
def test_the_hub_kernel_is_asked_for_at_the_commit_config_json_pins(hub, monkeypatch, route):
    """What each route asks `kernels` for (recorded; it answers with the local build): the repository and the commit
    that config.json names (`hub_kernel_revision`), never a branch or a version, and trust for that repository
    (Transformers' route takes it as a flag, the folder's own call as the repository's name); what it returns is the
    attention registered as the fused one. "transformers": Transformers' route for Hub attention kernels
    (`load_and_register_attn_kernel`, 5.25 with kernels 0.19, the locks); "kernels": that route unavailable, as under
    5.17 and 5.19, so the folder's own `kernels.get_kernel` call runs. (`LOCAL_KERNELS`, which the test without the
    package uses, ignores the revision asked for.)"""
    from transformers.integrations import hub_kernels
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from gated_qwen.model import attention_choice
    from gated_qwen.model.gating import FUSED_ATTENTION

    repo = "gated-qwen-test/pinned-kernel"
    for interface in (AttentionInterface, AttentionMaskInterface):  # the registry as it was, after the test
        mapping = interface._global_mapping
        for name in (FUSED_ATTENTION, f"{repo}@{COMMIT}:gated_attention_forward"):
            monkeypatch.setitem(mapping, name, mapping.get(name))
    monkeypatch.setattr(attention_choice, "HUB_KERNEL_FAILURES", {})
    calls = []

    def recording(called):
        def get_kernel(*args, **kwargs):
            calls.append((called, args, kwargs))
            return hub
        return get_kernel

    if route == "transformers" and hub_attention_kernel_loader() is None:
        pytest.skip("this Transformers has no route for Hub attention kernels (5.17, 5.19)")
    if route == "kernels":
        monkeypatch.delattr(hub_kernels, "load_and_register_attn_kernel", raising=False)
        assert hub_attention_kernel_loader() is None
    monkeypatch.setattr(hub_kernels, "get_kernel_hub", recording("transformers"), raising=False)
    monkeypatch.setattr(kernels, "get_kernel", recording("kernels"))
    config = GatedQwenConfig(**SMALL, hub_kernel_repo=repo, hub_kernel_revision=COMMIT)
    function = attention_choice.hub_kernel_attention(config)
    assert len(calls) == 1, calls
    (called, args, kwargs), = calls
    assert called == route and args == (repo,) and kwargs["revision"] == COMMIT and kwargs.get("version") is None
    assert kwargs["trust_remote_code"] == (True if route == "transformers" else [repo])
    assert function is hub.gated_attention_forward
    assert AttentionInterface._global_mapping[FUSED_ATTENTION] is hub.gated_attention_forward


def test_the_locked_transformers_offers_its_route_for_hub_attention_kernels():
    """Under the locks (Transformers 5.25, kernels 0.19) the folder's code loads its Hub kernel through Transformers'
    own route; the folder's own `kernels.get_kernel` call is the route of 5.17 and 5.19 only."""
    import transformers

    locked = Path(__file__).resolve().parents[2] / "requirements/cpu.lock"
    pinned = next(line.split("==")[1].split()[0] for line in locked.read_text().splitlines()
                  if line.startswith("transformers=="))
    if transformers.__version__ != pinned:
        pytest.skip(f"Transformers {transformers.__version__}, not the locked {pinned}")
    assert hub_attention_kernel_loader() is not None


def test_get_local_kernel_loads_its_own_module_with_its_own_ops(kernel_repo, hub):
    """The module is the repository's files (not the package's), named by the metadata id, and its custom ops live in
    a namespace of that name: the Hub copy runs its own code even beside the package."""
    import gated_qwen.kernel.parallel as package_parallel

    module_id = json.loads((kernel_repo / "build/torch-universal/metadata.json").read_text())["id"]
    assert hub.__name__ == module_id and Path(hub.__file__).is_relative_to(kernel_repo)
    assert hub.gated_attention is not package_parallel.gated_attention
    assert hub.gated_attention_forward.applies_output_gate is True
    assert hub.gated_attention_forward.runs_by_default is hub.runs_by_default
    hub_parallel = sys.modules[f"{module_id}.parallel"]
    assert hub_parallel._gated_attention_fwd_op is getattr(torch.ops, module_id).gated_attention_fwd.default
    assert hub_parallel._gated_attention_fwd_op is not package_parallel._gated_attention_fwd_op


def _inputs(case: str, seed: int = 0):
    """(q, k, v, gate, kwargs) of a small problem: two 64-wide blocks and a ragged tail under the interpreter."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE)

    d = 32
    if case == "varlen":
        lens_q, lens_k = [40, 1, 70], [45, 9, 70]
        cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
                      for n in (lens_q, lens_k))
        q, k, v = rnd(sum(lens_q), 4, d), rnd(sum(lens_k), 2, d), rnd(sum(lens_k), 2, d)
        kwargs = {"causal": True, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": 70, "max_seqlen_k": 70}
        return q, k, v, rnd(sum(lens_q), 4, 2 * d)[..., d:], kwargs
    if case == "decode":
        return rnd(2, 1, 8, d), rnd(2, 90, 2, d), rnd(2, 90, 2, d), rnd(2, 1, 8, 1), {"causal": True}
    h_kv, causal = {"gqa-elementwise": (2, True), "gqa-headwise": (1, False)}[case]
    gate = rnd(2, 70, 4, d) if case == "gqa-elementwise" else rnd(2, 70, 4, 1)
    return rnd(2, 70, 4, d), rnd(2, 70, h_kv, d), rnd(2, 70, h_kv, d), gate, {"causal": causal}


@pytest.mark.parametrize("case", ["gqa-elementwise", "gqa-headwise", "varlen", "decode"])
def test_the_hub_kernels_gated_attention_equals_the_reference(hub, case):
    """Output and every gradient (q, k, v, gate) of the Hub module's `gated_attention` against the package's
    `naive_gated_attention` in fp64; the Hub module's own launcher ran (its forward, counted)."""
    q, k, v, gate, kwargs = _inputs(case)
    hub_parallel = sys.modules[f"{hub.__name__}.parallel"]
    launches = []
    forward = hub_parallel.decode_forward if q.shape[-3] == 1 and "cu_seqlens_q" not in kwargs else hub_parallel.forward
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hub_parallel, forward.__name__, lambda *a: launches.append(a) or forward(*a))
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, gate)]
        out = hub.gated_attention(*leaves, **kwargs)
    assert len(launches) == 1  # the Hub copy's forward ran, once
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out.backward(dy)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v, gate)]
    expected = naive_gated_attention(*reference, **kwargs)
    expected.backward(dy.double())
    errors = {name: ((got.double() - want).abs().max() / want.abs().max()).item() for name, got, want in zip(
        ("out", "dq", "dk", "dv", "dgate"), [out, *(t.grad for t in leaves)], [expected, *(t.grad for t in reference)])}
    assert max(errors.values()) <= TOL, errors


# The saved folder's own code, in a fresh interpreter without the package: argv = folders (JSON), repository path,
# the expected logits (.pt). Prints one JSON object of what it saw.
WITHOUT_THE_PACKAGE = r"""
import json, logging, os, sys
sys.modules["gated_qwen"] = None  # the package is not installed on this machine
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging as hf_logging

folders, repository, expected = json.loads(sys.argv[1]), sys.argv[2], torch.load(sys.argv[3])
TRANSFORMERS_NEEDS_KERNELS = json.loads(sys.argv[4])
records, seen, loads = [], {}, []
import kernels
from transformers.integrations import hub_kernels


def recording(route, get_kernel):  # get_kernel, noting each repository and revision asked for, and the route
    return lambda repo, *args, **kwargs: loads.append([route, repo, kwargs.get("revision")]) or get_kernel(
        repo, *args, **kwargs)


kernels.get_kernel = recording("kernels", kernels.get_kernel)  # what the folder's own loader calls
if hasattr(hub_kernels, "get_kernel_hub"):  # what Transformers' route calls (its own reference to kernels')
    hub_kernels.get_kernel_hub = recording("transformers", hub_kernels.get_kernel_hub)
handler = logging.Handler()
handler.emit = records.append
hf_logging.get_logger("transformers_modules").addHandler(handler)
hf_logging.get_logger("transformers_modules").setLevel(logging.INFO)


def load(name):
    records.clear()
    loads.clear()
    model = AutoModelForCausalLM.from_pretrained(folders[name], trust_remote_code=True)
    lines = [(logging.getLevelName(r.levelno), r.getMessage()) for r in records if "GatedQwen" in r.getMessage()]
    return model, {"attention": model.config._attn_implementation, "lines": lines, "loads": list(loads)}


_, seen["cpu"] = load("hub")  # a CPU: no Hub access at all
torch.cuda.is_available = lambda: True  # the dispatch decision of a CUDA machine; the kernel runs interpreted
if not TRANSFORMERS_NEEDS_KERNELS:  # kernels not installed, where Transformers runs without it
    sys.modules["kernels"] = None
    _, seen["no kernels"] = load("hub")
    sys.modules["kernels"] = kernels  # installed again: the same module, its get_kernel still recorded
_, seen["not on the Hub"] = load("missing")  # HF_HUB_OFFLINE, no local override of this repository: does not load
os.environ["LOCAL_KERNELS"] = f"{folders['repo id']}={repository}"  # kernels' own stand-in for the Hub repository
model, seen["hub"] = load("hub")
function = ALL_ATTENTION_FUNCTIONS["gated_triton"]
seen["hub"]["function"] = function.__module__
attention = sys.modules[function.__module__]
launches, kernel = [], attention.gated_attention
attention.gated_attention = lambda q, k, v, gate=None, **kw: launches.append(
    [None if gate is None else list(gate.shape), kw.get("max_seqlen_q", q.shape[1])]) or kernel(q, k, v, gate, **kw)
with torch.no_grad():
    logits = model(expected["ids"]).logits
seen["hub"]["launches"] = launches
seen["hub"]["self-check"] = {combo.describe(): verdict for combo, verdict in attention.SELF_CHECK_VERDICTS.items()}
seen["hub"]["error"] = ((logits - expected["logits"]).abs().max() / expected["logits"].abs().max()).item()
print(json.dumps(seen))
"""


@pytest.mark.slow  # a fresh interpreter
def test_a_saved_folder_without_the_package_uses_the_hub_kernel_its_config_names(tmp_path, kernel_repo):
    config = GatedQwenConfig(**SMALL)
    sdpa = randomize_(GatedQwenForCausalLM(config), seed=3).eval()
    sdpa.set_attn_implementation("sdpa")
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.save({"ids": ids, "logits": sdpa(ids).logits}, tmp_path / "expected.pt")
    sdpa.config.hub_kernel_repo, sdpa.config.hub_kernel_revision = REPO_ID, COMMIT  # set at save time
    sdpa.save_pretrained(tmp_path / "hub")
    sdpa.config.hub_kernel_repo = "gated-qwen-test/not-uploaded"
    sdpa.save_pretrained(tmp_path / "missing")
    saved = json.loads((tmp_path / "hub" / "config.json").read_text())
    assert (saved["hub_kernel_repo"], saved["hub_kernel_revision"]) == (REPO_ID, COMMIT)
    folders = {"hub": str(tmp_path / "hub"), "missing": str(tmp_path / "missing"), "repo id": REPO_ID}
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_KERNELS"} | {
        "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}
    # Transformers 5.25 requires kernels (its from_pretrained imports it): no machine has that release without it.
    needs_kernels = any(r.split(";")[0].replace(" ", "").startswith("kernels") and "extra" not in r
                        for r in importlib.metadata.requires("transformers") or [])
    result = subprocess.run([sys.executable, "-c", WITHOUT_THE_PACKAGE, json.dumps(folders), str(kernel_repo),
                             str(tmp_path / "expected.pt"), json.dumps(needs_kernels)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])

    # Transformers' own route where the installed Transformers offers it, else the folder's own call of kernels.
    route = "transformers" if hub_attention_kernel_loader() is not None else "kernels"
    cpu = seen["cpu"]
    assert cpu["attention"] == "sdpa" and cpu["loads"] == []
    assert [level for level, _ in cpu["lines"]] == ["INFO"] and "kernels library is installed" in cpu["lines"][0][1]
    assert REPO_ID in cpu["lines"][0][1]
    assert ("no kernels" in seen) == (not needs_kernels)
    if not needs_kernels:
        no_kernels = seen["no kernels"]
        assert no_kernels["attention"] == "sdpa" and [level for level, _ in no_kernels["lines"]] == ["WARNING"]
        assert "kernels library is installed" in no_kernels["lines"][0][1]
        assert "then import gated_qwen" in no_kernels["lines"][0][1]
    missing = seen["not on the Hub"]
    assert missing["attention"] == "sdpa" and [level for level, _ in missing["lines"]] == ["WARNING"]
    assert "gated-qwen-test/not-uploaded" in missing["lines"][0][1] and "did not load" in missing["lines"][0][1]
    assert missing["loads"] == [[route, "gated-qwen-test/not-uploaded", COMMIT]]

    hub = seen["hub"]
    module_id = kernel_hub.metadata(kernel_hub.source_digest(kernel_hub.kernel_sources()))["id"]
    assert hub["attention"] == "gated_triton" and hub["function"] == f"{module_id}.attention"
    assert [level for level, _ in hub["lines"]] == ["INFO"] and REPO_ID in hub["lines"][0][1]
    assert hub["loads"] == [[route, REPO_ID, COMMIT]]  # once, at the commit config.json pins
    # Each layer launched the Hub module's kernel with the G1 gate fused ([B, S, Hq, D] logits), on the whole batch.
    assert hub["launches"] == [[[2, 24, config.num_attention_heads, config.head_dim], 24]] * config.num_hidden_layers
    assert list(hub["self-check"].values()) == [None]  # the Hub copy checked itself first, and passed
    assert hub["error"] <= 2e-5  # fp32; the fused kernel multiplies its fp32 accumulator, sdpa the rounded output
