"""`single_thread`: a fixture that runs a test module's tiny models on one intra-op thread.

Models of a few thousand parameters gain nothing from more threads, and on a machine loaded by other processes
each parallel region waits for descheduled threads: a 40-step Trainer run measured 0.8 s on one thread and 64 s on
two on the shared 2-core machine. Use with `pytestmark = pytest.mark.usefixtures("single_thread")` after importing it.
"""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
