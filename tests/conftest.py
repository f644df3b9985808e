import os

# One intra-op thread per test process: CI has 2 cores, and the tests compare tokens, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from .helpers_server import shared_server  # noqa: E402,F401 - one nemo-serve process for e2e and browser tests

torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: builds the large architectures; deselect with -m 'not slow'")
