"""What the paper measures, on your own models, and its claims reproduced in miniature.

- `measure`: F-Attn (first-token attention, without the S x S map), M-Act, |SDPA output| before and after the
  gate, gate statistics (`analyze`); perplexity against context length with and without YaRN.
- `data`: the built-in synthetic corpora (Bigram-Backcopy, bigram chain with repeats).
- `reproduce`: trains tiny baseline / gated / control models with the Transformers `Trainer` and measures them.
- `cli`: `gated-qwen analyze`, `gated-qwen eval-ppl`, `gated-qwen reproduce`.

The names below are imported on first use, so that the command line can load `cli` without the model stack.
"""

import importlib

_EXPORTS = {"BigramBackcopy": "data", "SyntheticLanguage": "data", "analyze": "measure",
            "first_token_attention": "measure", "mean_nll": "measure", "perplexity_by_length": "measure",
            "with_yarn": "measure"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
