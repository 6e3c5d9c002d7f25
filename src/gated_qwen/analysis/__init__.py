"""What the paper measures, on your own models, and its claims reproduced in miniature.

- `measure`: F-Attn (first-token attention, without the S x S map), M-Act, |SDPA output| before and after the
  gate, gate statistics (`analyze`); perplexity against context length with and without YaRN.
- `data`: the built-in synthetic corpora (Bigram-Backcopy, bigram chain with repeats).
- `reproduce`: trains tiny baseline / gated / control models with the Transformers `Trainer` and measures them.
- `cli`: `gated-qwen analyze`, `gated-qwen eval-ppl`, `gated-qwen reproduce`.
"""

from .data import BigramBackcopy, SyntheticLanguage
from .measure import analyze, first_token_attention, mean_nll, perplexity_by_length, with_yarn

__all__ = ["BigramBackcopy", "SyntheticLanguage", "analyze", "first_token_attention", "mean_nll", "perplexity_by_length", "with_yarn"]
