"""Keepalive through the real server (docs/server.md, Limits; protocol.md, Timeouts and keepalive):
a /ws or /v1/realtime client that stops answering pings is closed with 1011 "keepalive ping
timeout" on --port (uvicorn), with 1001 and picows's reason on --fast-ws-port, and its slot comes
back. The client is aiohttp's with `autoping=False`: a real client library whose pong is
suppressed (websockets' clients always answer). A client that answers is left alone. One server,
pings every 1 s with a 1 s timeout; every case runs at once."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

aiohttp = pytest.importorskip("aiohttp")

from .helpers_server import TOKEN, free_port, start_server  # noqa: E402

PING_S = 1.0  # not shorter: a loaded CI machine could hold back a pong (or its reading) that long
ROUTES = {"/ws": {"type": "config"}, "/v1/realtime?intent=transcription": None}
PICOWS_REASON = f"peer has not replied to ping/heartbeat request within {PING_S} second(s)"


@pytest.fixture(scope="module")
def pinging():
    pytest.importorskip("picows")
    port = free_port()
    with start_server("--num-slots", "6", "--fast-ws-port", str(port), "--ping-interval-s", str(PING_S),
                      "--ping-timeout-s", str(PING_S)) as s:  # fmt: skip
        s.fast_url = f"ws://127.0.0.1:{port}"
        yield s


async def _session(url: str, first: dict | None, answer: bool, hold_s: float) -> tuple[int | None, str, int, float]:
    """(close code, close reason, pings seen, seconds to the close) of a client that reads every
    message but, with answer=False, never sends a pong; with answer=True (aiohttp's pongs on), one
    that ends its stream (`end`) after `hold_s`, several ping periods: the server's 1000."""
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url, autoping=answer, headers={"Authorization": f"Bearer {TOKEN}"})
        if first is not None:
            await ws.send_str(json.dumps(first))
        t0, pings = time.monotonic(), 0
        if answer:
            asyncio.get_running_loop().call_later(hold_s, asyncio.ensure_future, ws.send_str('{"type": "end"}'))
        while True:
            m = await ws.receive(timeout=15)
            if m.type == aiohttp.WSMsgType.PING:
                pings += 1  # not answered: autoping=False hands it here instead of sending the pong
            elif m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                return ws.close_code, m.extra or "", pings, time.monotonic() - t0


def test_a_client_that_stops_answering_pings_is_closed(pinging):
    uvicorn_url = f"ws://127.0.0.1:{pinging.port}"
    cases = [(base, route, False) for base in (uvicorn_url, pinging.fast_url) for route in ROUTES]
    cases += [(uvicorn_url, "/ws", True), (pinging.fast_url, "/ws", True)]  # answers: open after several pings

    async def scenario():
        return await asyncio.gather(*(_session(base + route, ROUTES[route], answer, hold_s=3 * PING_S)
                                      for base, route, answer in cases))  # fmt: skip

    outcomes = dict(zip(cases, asyncio.run(scenario())))
    for (base, route, answer), (code, reason, pings, seconds) in outcomes.items():
        if answer:
            assert code == 1000 and seconds >= 3 * PING_S, (route, code, reason, seconds)  # open until its `end`
            continue
        expected = (1011, "keepalive ping timeout") if base == uvicorn_url else (1001, PICOWS_REASON)
        assert (code, reason) == expected, (base, route, code, reason)
        assert pings == 1 and seconds < 10 * PING_S, (base, route, pings, seconds)
    pinging.wait_open_streams(0)
    pinging.assert_no_leak()
