"""In-process session tests' shared pieces: a ServerContext over an in-process engine, and the
wait for every slot to come back (test_stream_session.py, test_ws_socket.py, test_realtime_items.py)."""

from __future__ import annotations

import asyncio

from nemo_serve.compose import server_context
from nemo_serve.config import Settings


def context(engine, **settings):
    """The ServerContext the front end would build, with `settings` over the defaults."""
    return server_context(engine, Settings.from_sources(settings, {}))


async def until_slots_free(engine, timeout_s: float = 10.0) -> None:
    """Every slot free and no stream open (a release lands between steps)."""
    async with asyncio.timeout(timeout_s):
        while engine.num_free_slots < engine.num_slots or engine.num_open_streams:
            await asyncio.sleep(0.01)
