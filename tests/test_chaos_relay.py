"""The emulated link's fault modes (the chaos harness) act on live connections."""
from __future__ import annotations

import asyncio

import pytest

from ember.cluster.ports import free_port
from ember.cluster.wan import LinkState, Relay, serve


async def echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    port = free_port()
    return await asyncio.start_server(echo, "127.0.0.1", port), f"127.0.0.1:{port}"


async def read_some(reader, timeout=0.5) -> bytes | None:
    try:
        return await asyncio.wait_for(reader.read(65536), timeout)
    except TimeoutError:
        return None


def test_fault_modes_act_on_live_connections():
    async def go():
        server, target = await echo_server()
        listen = f"127.0.0.1:{free_port()}"
        states: dict[str, LinkState] = {}
        relays = await serve([Relay(listen, target, rtt_ms=2, gbps=1.0)], states)
        state = states[listen]
        host, port = listen.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"ping")
        assert await read_some(reader, 5) == b"ping"
        state.set("blackhole")
        writer.write(b"lost")
        assert await read_some(reader) is None, "a blackholed link delivers nothing"
        state.set("stall")
        writer.write(b"held")
        assert await read_some(reader, 0.3) is None
        state.set("none")
        assert await read_some(reader, 5) == b"held", "a stalled link delivers once it recovers"
        state.set("reset")
        got = await read_some(reader, 5)
        assert got == b"", "reset closes live connections"
        r2, w2 = await asyncio.open_connection(host, int(port))
        assert await read_some(r2, 5) == b"", "and refuses new ones"
        state.set("none")
        r3, w3 = await asyncio.open_connection(host, int(port))
        w3.write(b"back")
        assert await read_some(r3, 5) == b"back"
        with pytest.raises(ValueError, match="fault mode"):
            state.set("explode")
        for s in relays + [server]:
            s.close()
    asyncio.run(asyncio.wait_for(go(), 30))
