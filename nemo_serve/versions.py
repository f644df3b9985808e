"""Version checks for the adapters that reach into another project's private API
(server/uvicorn_protocols.py, nemo_private.py): an upgrade past what was tested fails at import,
in one place, with a message that names the package and the range, not later as an
AttributeError deep in a request. NEMO_SERVE_ALLOW_UNTESTED=1 turns the failure into a warning
(to try a newer release on purpose)."""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re

log = logging.getLogger("nemo_serve")


def release(version: str) -> tuple[int, ...]:
    """'0.54.0' -> (0, 54, 0); '2.13.0+cpu', '3.0.0rc1' -> their numeric release part."""
    m = re.match(r"\d+(\.\d+)*", version)
    if m is None:
        raise ValueError(f"not a version: {version!r}")
    return tuple(int(x) for x in m.group().split("."))


def in_range(version: str, minimum: str, below: str) -> bool:
    return release(minimum) <= release(version) < release(below)


def require(distribution: str, minimum: str, below: str, uses: str) -> str:
    """The installed version of `distribution`; ImportError unless minimum <= it < below."""
    version = importlib.metadata.version(distribution)
    if not in_range(version, minimum, below):
        message = (f"{distribution} {version} is outside the range nemo-serve was tested with (>={minimum},<{below}); "
                   f"nemo-serve uses its private {uses}. Install a version in the range "
                   f"(pip install '{distribution}>={minimum},<{below}'), or set NEMO_SERVE_ALLOW_UNTESTED=1 to try it")  # fmt: skip
        if os.environ.get("NEMO_SERVE_ALLOW_UNTESTED") != "1":
            raise ImportError(message)
        log.warning("%s", message)
    return version
