"""What the paper measures, on your own models, and its claims reproduced in miniature.

- `measure`: F-Attn (first-token attention, without the S x S map), M-Act, |SDPA output| before and after the
  gate, gate statistics (`analyze`); perplexity against context length with and without YaRN.
- `data`: the built-in synthetic corpora (Bigram-Backcopy, bigram chain with repeats).
- `reproduce`: trains tiny baseline / gated / control models with the Transformers `Trainer` and measures them.
- `cli`: `gated-qwen analyze`, `gated-qwen eval-ppl`, `gated-qwen reproduce`.

The names below are imported on first use, so that the command line can load `cli` without the model stack.
"""

__all__ = ["BigramBackcopy", "SyntheticLanguage", "analyze", "first_token_attention", "mean_nll",
           "perplexity_by_length", "with_yarn"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import data, measure

    return getattr(data if hasattr(data, name) else measure, name)
