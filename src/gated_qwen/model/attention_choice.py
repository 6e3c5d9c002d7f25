"""Which attention a GatedQwen model runs by default, and the Hub kernel's loading: the fused attention the
registry offers for a config (the gated_qwen package's kernel where the package is imported, else, on a CUDA GPU, the
Hub kernel config.json names), else Transformers' choice with the gate applied after it, said in one log line with
what would give the fused kernel. `GatedQwenPreTrainedModel.get_correct_attn_implementation` asks `choose_attention`.

This file is copied to the Hugging Face Hub beside `modeling_gated.py`: relative imports only.
"""

from collections.abc import Callable

import torch
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.utils import logging

from .configuration_gated import GatedQwenConfig
from .gating import FUSED_ATTENTION
from .transformers_compat import hub_attention_kernel_loader

logger = logging.get_logger(__name__)
PACKAGE_KERNEL_HINT = (f"the fused Triton kernel with the gate in its epilogue (attn_implementation='{FUSED_ATTENTION}') "
                       "runs on a CUDA GPU where the gated_qwen package, with Triton, is imported before the model is "
                       "loaded")
# The Hub kernels that did not load in this process, and why: {(repo, revision): reason}. Tried once each.
HUB_KERNEL_FAILURES: dict[tuple[str, str], str] = {}


def hub_kernel_attention(config: GatedQwenConfig) -> Callable | None:
    """The attention function of the Hub kernel that `config` names (`hub_kernel_repo` at the commit
    `hub_kernel_revision`: the gated_qwen package's kernel as a Hub kernel), registered in Transformers' attention
    registry as the fused attention, with its mask; None where the config names none, `kernels` is not installed, or
    the kernel does not load (`HUB_KERNEL_FAILURES` says why). Loaded through Transformers' own route for Hub attention
    kernels where it has one (`hub_attention_kernel_loader`: "repo@revision:gated_attention_forward"), else with
    `kernels.get_kernel` at that commit. The repository is allowed because this folder's own config.json names it
    (Transformers' route takes the permission as a flag, `kernels` as the repository's name)."""
    repo, revision = config.hub_kernel_repo, config.hub_kernel_revision
    if repo is None or (repo, revision) in HUB_KERNEL_FAILURES:
        return None
    try:
        import kernels
    except ImportError:
        return None
    load_attention_kernel = hub_attention_kernel_loader()
    try:
        if load_attention_kernel is not None:
            name = f"{repo}@{revision}:gated_attention_forward"
            load_attention_kernel(name, allow_all_kernels=True)
            function = ALL_ATTENTION_FUNCTIONS[name]
        else:
            function = kernels.get_kernel(repo, revision=revision, trust_remote_code=[repo]).gated_attention_forward
    except Exception as error:  # no network, no such commit, a `kernels` too old: said in the model's one log line
        message = str(error).strip().splitlines()
        HUB_KERNEL_FAILURES[repo, revision] = f"{type(error).__name__}: {message[0][:300] if message else ''}"
        return None
    AttentionInterface.register(FUSED_ATTENTION, function)
    AttentionMaskInterface.register(FUSED_ATTENTION, flash_attention_mask)
    logger.info_once(f"GatedQwen: the fused attention is the Hub kernel {repo} at {revision}")
    return function


def fused_kernel_hint(config: GatedQwenConfig) -> str:
    """What would give the fused kernel, for the one log line of a model that runs SDPA and the gate."""
    repo, revision = config.hub_kernel_repo, config.hub_kernel_revision
    if repo is None:
        return PACKAGE_KERNEL_HINT
    hub = f"the Hub kernel {repo} at {revision[:12]} that config.json names"
    if (repo, revision) in HUB_KERNEL_FAILURES:
        return f"{hub} did not load ({HUB_KERNEL_FAILURES[repo, revision]}); else {PACKAGE_KERNEL_HINT}"
    return (f"{hub} runs on a CUDA GPU where Hugging Face's kernels library is installed; or "
            f"{PACKAGE_KERNEL_HINT}")


def fused_attention(config: GatedQwenConfig) -> str | None:
    """The fused attention that runs by default for `config`, found in Transformers' attention registry: the
    gated_qwen package's kernel where the package has registered it (importing the package does), else, on a CUDA
    GPU, the Hub kernel config.json names (`hub_kernel_attention`), where it says it runs by default for this config
    (its `runs_by_default(config)`: a CUDA GPU, Triton, no sliding windows, no attention dropout); else None."""
    function = ALL_ATTENTION_FUNCTIONS.get(FUSED_ATTENTION)
    if function is None and torch.cuda.is_available():
        function = hub_kernel_attention(config)
    runs_by_default = getattr(function, "runs_by_default", None)
    return FUSED_ATTENTION if runs_by_default is not None and runs_by_default(config) else None


def choose_attention(config: GatedQwenConfig, requested: str | None, transformers_choice: Callable[[], str]) -> str:
    """The attention that runs: by default the fused attention the registry offers for `config`
    (`fused_attention`), else Transformers' choice (`transformers_choice()`, e.g. `sdpa`) with the gate applied after
    it, which one log line says along with how to get the fused kernel (a warning on a CUDA GPU). Asked for by name
    (`requested`), the fused attention is the package's, else the Hub kernel config.json names (on any device)."""
    if requested == FUSED_ATTENTION and FUSED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        if hub_kernel_attention(config) is None:
            raise ValueError(f"attn_implementation={FUSED_ATTENTION!r} needs the fused kernel: "
                             f"{fused_kernel_hint(config)}")
    if requested is not None:
        return transformers_choice()
    fused = fused_attention(config)
    if fused is not None:
        return fused
    chosen = transformers_choice()
    if FUSED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:  # said where the fused kernel could have run
        log = logger.warning_once if torch.cuda.is_available() else logger.info_once
        log(f"GatedQwen: attention runs as {chosen!r} with a separate sigmoid gate; {fused_kernel_hint(config)}")
    return chosen
