"""Test-wide setup.

Without a GPU the Triton kernel runs under the Triton interpreter; that switch must be set before any
`@triton.jit` function is defined, i.e. before `gated_qwen` is imported anywhere in the test process.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
