"""Test-wide setup.

The tests' models are tiny: they gain nothing from several intra-op threads, and on a loaded 2-core machine every
parallel region waits for descheduled threads (a 40-step Trainer run took 0.8 s on one thread, 64 s on two), so the
suite runs on one thread per process (`make test` runs two processes).

Without a GPU the Triton kernel runs under the Triton interpreter; that switch must be set before any
`@triton.jit` function is defined, i.e. before `gated_qwen` is imported anywhere in the test process.
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass
