"""What the paper measures, on your own models, and its claims reproduced in miniature.

- `measure`: F-Attn (first-token attention, without the S x S map), M-Act, |SDPA output| before and after the
  gate, gate statistics (`analyze`); perplexity against context length with and without YaRN; recall accuracy.
- `quantize`: held-out perplexity under fake quantization (W8A8 per tensor / per token, W4A8, W4A4).
- `data`: the built-in synthetic corpora (Bigram-Backcopy, bigram chain with repeats, key -> value recall).
- `reproduce`: trains tiny baseline / gated / control models with the Transformers `Trainer` and measures them.
- `cli`: `gated-qwen analyze`, `gated-qwen eval-ppl`, `gated-qwen reproduce`.

The names below are imported on first use, so that the command line can load `cli` without the model stack.
"""

__all__ = ["BigramBackcopy", "KeyValueRecall", "SyntheticLanguage", "analyze", "first_token_attention", "mean_nll",
           "perplexity_by_length", "recall_accuracy", "with_yarn", "SCHEMES", "fake_quantized",
           "perplexity_under_quantization"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import data, measure, quantize

    return getattr(next(module for module in (data, measure, quantize) if hasattr(module, name)), name)
