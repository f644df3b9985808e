"""Results cross from the engine's thread to a front end's event loop here."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


def hand_over(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run `fn(*args)` on `loop` soon; safe from any thread. Dropped once the loop is closed
    (shutdown): nobody is listening any more."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass
