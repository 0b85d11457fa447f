"""Emulated wide-area links on one machine (kernel netem is not available here).

A relay listens on a local port and forwards each connection to its target, both ways,
delaying every chunk by half the link's RTT and pacing it to the link's bandwidth (a
serialisation queue, as a real link has). `ember up` starts one relay process for the
whole cluster (`python -m ember.cluster.wan --spec FILE`) and points every inter-site hop
through its relay: router -> remote prefill/decode, kvstore -> remote kvstore (gRPC and
data plane). Same-site traffic never crosses a relay.

Spec (JSON): [{"listen": "127.0.0.1:P", "target": "127.0.0.1:Q", "rtt_ms": 40, "gbps": 1.0}, ...]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass

_CHUNK = 64 * 1024


@dataclass(frozen=True)
class Relay:
    listen: str
    target: str
    rtt_ms: float
    gbps: float


def parse_routes(items: list[str]) -> dict[str, str]:
    """["TRUE=RELAY", ...] -> {true address: relay address}."""
    routes = {}
    for item in items:
        true, sep, relay = item.partition("=")
        if not sep or not true or not relay:
            raise ValueError(f"route {item!r} is not ADDRESS=RELAY")
        routes[true] = relay
    return routes


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float,
                bytes_per_s: float) -> None:
    """Copy one direction: each chunk leaves the 'wire' after its serialisation time plus the delay."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=256)  # ~16 MiB in flight at most
    loop = asyncio.get_running_loop()

    async def deliver():
        while True:
            at, data = await queue.get()
            if data is None:
                writer.close()
                return
            wait = at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
    sender = loop.create_task(deliver())
    wire_free = loop.time()
    try:
        while data := await reader.read(_CHUNK):
            wire_free = max(loop.time(), wire_free) + len(data) / bytes_per_s
            await queue.put((wire_free + delay_s, data))
    except ConnectionError:
        pass
    finally:
        await queue.put((0.0, None))
        try:
            await sender
        except ConnectionError:
            pass


async def serve(relays: list[Relay]) -> list[asyncio.AbstractServer]:
    servers = []
    for relay in relays:
        async def handle(reader, writer, relay=relay):
            host, port = relay.target.rsplit(":", 1)
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            except OSError:
                writer.close()
                return
            delay, rate = relay.rtt_ms / 2e3, relay.gbps * 1e9 / 8
            await asyncio.gather(_pump(reader, up_writer, delay, rate), _pump(up_reader, writer, delay, rate),
                                 return_exceptions=True)
        host, port = relay.listen.rsplit(":", 1)
        servers.append(await asyncio.start_server(handle, host, int(port)))
    return servers


def main() -> None:
    p = argparse.ArgumentParser(prog="ember.cluster.wan")
    p.add_argument("--spec", required=True, help="JSON list of relays")
    args = p.parse_args()
    relays = [Relay(**r) for r in json.loads(open(args.spec).read())]

    async def run():
        await serve(relays)
        print(f"{time.strftime('%H:%M:%S')} relaying {len(relays)} emulated links", flush=True)
        await asyncio.Event().wait()
    import uvloop
    uvloop.run(run())


if __name__ == "__main__":
    main()
