"""What the paper measures, on your own models (this package's modules), and its claims tested in miniature
(`miniature`: `gated-qwen reproduce`, `make demo`, `make confirm`).

- `measure`: F-Attn (first-token attention, without the S x S map), per layer and head, M-Act (also at the first
  token), |SDPA output| before and after the gate, gate statistics (`analyze`);
- `perplexity`: perplexity against context length with and without YaRN; recall accuracy.
- `quantize`: held-out perplexity under fake quantization (W8A8 per tensor / per token, W4A8, W4A4).
- `cli`, `commands`, `inputs`, `memory`, `report`, `plots`: `gated-qwen analyze` and `gated-qwen eval-ppl` (and the
  parser of `reproduce`).
- `miniature`: the paper in miniature: built-in corpora, presets, runs, directions, statistics, the report.
"""

from .measure import analyze, first_token_attention
from .miniature.corpora import BigramBackcopy, KeyValueRecall, SyntheticLanguage, TrigramLanguage
from .perplexity import mean_nll, perplexity_by_length, recall_accuracy, with_yarn
from .quantize import SCHEMES, fake_quantized, perplexity_under_quantization

__all__ = ["BigramBackcopy", "KeyValueRecall", "SyntheticLanguage", "TrigramLanguage", "analyze",
           "first_token_attention", "mean_nll", "perplexity_by_length", "recall_accuracy", "with_yarn", "SCHEMES",
           "fake_quantized", "perplexity_under_quantization"]
