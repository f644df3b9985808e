import os

# One intra-op thread per test process: CI has 2 cores, and the tests compare tokens, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from .helpers_riva import riva_server  # noqa: E402,F401 - one --grpc-port server for the two Riva files
from .helpers_server import shared_server  # noqa: E402,F401 - one nemo-serve process for e2e and browser tests
from .helpers_server import diarizing_server  # noqa: E402,F401 - one for the two diarization server files
from .helpers_server import demo_pair_server  # noqa: E402,F401 - the demo model for two files' client runs
from .helpers_server import tokenless_server  # noqa: E402,F401 - no token: the load generator's and a NIM session's
from .helpers_server import deepgram_server  # noqa: E402,F401 - /v1/listen's two files

torch.set_num_threads(1)


def pytest_configure(config):
    # Slow tests run by default, in CI too (tests/test_builtin.py: about 2 min of CPU, 4.5 GB).
    config.addinivalue_line("markers", "slow: builds the large architectures; deselect with -m 'not slow'")


import pytest  # noqa: E402

from .helpers_server import release_after  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown (leak checks included): stop the shared servers it was the last user of."""
    yield
    release_after(item)


@pytest.fixture(autouse=True)
def _grad_mode_is_left_as_found():
    """Grad mode is per thread and global within it: a test (or the code it calls) that switches it off on
    pytest's thread would make every later training test fail far from the cause. Fail the leaker instead."""
    yield
    leaked = not torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    assert not leaked, "this test left torch's grad mode disabled on the main thread"
