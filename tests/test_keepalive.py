"""Keepalive through the real server (docs/server.md, Limits; protocol.md, Timeouts and keepalive):
on --port (uvicorn) and --fast-ws-port (picows) alike, the server pings every interval whether or not
the client sends, and a /ws or /v1/realtime client that does not answer a ping within the timeout is
closed with 1011 "keepalive ping timeout" (also while it keeps sending audio: a half-dead peer that
still writes), and its slot comes back. A client that answers is left alone. The client is
aiohttp's with `autoping=False`: a real client library whose pongs are ours to send or withhold
(websockets' clients always answer). One server, pings every 1 s with a 1 s timeout; every case runs
at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import numpy as np

import pytest

aiohttp = pytest.importorskip("aiohttp")

from .helpers_server import TOKEN, free_port, start_server  # noqa: E402

PING_S = 1.0  # not shorter: a loaded CI machine could hold back a pong (or its reading) that long
ROUTES = {"/ws": {"type": "config"}, "/v1/realtime?intent=transcription": None,
          "/v1/listen?encoding=linear16&sample_rate=16000": {"type": "KeepAlive"}}  # Deepgram's: its KeepAlive is no pong


@pytest.fixture(scope="module")
def pinging():
    pytest.importorskip("picows")
    port = free_port()
    with start_server("--num-slots", "8", "--fast-ws-port", str(port), "--ping-interval-s", str(PING_S),
                      "--ping-timeout-s", str(PING_S)) as s:  # fmt: skip
        s.fast_url = f"ws://127.0.0.1:{port}"
        yield s


SILENT, ANSWERS, SENDS = "silent", "answers", "sends"  # what a client does besides reading
PACKET = np.zeros(4000, "<f4").tobytes()  # 0.25 s of silence at 16 kHz (the config's defaults)


async def _session(url: str, first: dict | None, does: str, hold_s: float) -> tuple[int | None, str, int, float]:
    """(close code, close reason, pings seen, seconds to the close) of a client that reads every
    message and, SILENT, sends nothing more and no pong; ANSWERS, answers each ping with its pong
    and ends its stream (`end`) after `hold_s`, several ping periods (the server's 1000); SENDS,
    sends no pong but audio every 0.25 s for `hold_s`, then `end`."""
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(url, autoping=False, headers={"Authorization": f"Bearer {TOKEN}"})
        if first is not None:
            await ws.send_str(json.dumps(first))
        t0, pings = time.monotonic(), 0

        async def send() -> None:
            with contextlib.suppress(ConnectionError):  # closed under it: the reader says how
                while does == SENDS and time.monotonic() - t0 < hold_s:
                    await ws.send_bytes(PACKET)
                    await asyncio.sleep(0.25)
                if does != SILENT:
                    await asyncio.sleep(max(0.0, hold_s - (time.monotonic() - t0)))
                    await ws.send_str('{"type": "end"}')

        sender = asyncio.create_task(send())
        while True:
            m = await ws.receive(timeout=15)
            if m.type == aiohttp.WSMsgType.PING:
                pings += 1  # autoping=False hands it here instead of sending the pong
                if does == ANSWERS:
                    await ws.pong(m.data)
            elif m.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING):
                sender.cancel()
                return ws.close_code, m.extra or "", pings, time.monotonic() - t0


def test_a_client_that_stops_answering_pings_is_closed_on_both_ports(pinging):
    """Both ports ping every interval: a client that sends audio but no pong is closed as a silent
    one is (1011 after its first ping), and one that answers gets a ping each interval and stays."""
    uvicorn_url = f"ws://127.0.0.1:{pinging.port}"
    cases = [(base, route, SILENT) for base in (uvicorn_url, pinging.fast_url) for route in ROUTES]
    cases += [(base, "/ws", does) for base in (uvicorn_url, pinging.fast_url) for does in (ANSWERS, SENDS)]

    async def scenario():
        return await asyncio.gather(*(_session(base + route, ROUTES[route], does, hold_s=3 * PING_S)
                                      for base, route, does in cases))  # fmt: skip

    outcomes = dict(zip(cases, asyncio.run(scenario())))
    for (base, route, does), (code, reason, pings, seconds) in outcomes.items():
        if does == ANSWERS:  # open until its `end`, pinged every interval meanwhile
            assert code == 1000 and seconds >= 3 * PING_S, (base, does, code, reason, seconds)
            assert pings >= 2, (base, does, pings)
            continue
        assert (code, reason) == (1011, "keepalive ping timeout"), (base, route, does, code, reason)
        assert pings == 1 and seconds < 10 * PING_S, (base, route, does, pings, seconds)
    pinging.wait_open_streams(0)
    pinging.assert_no_leak()
