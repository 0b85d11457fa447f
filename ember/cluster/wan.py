"""Emulated wide-area links on one machine (kernel netem is not available here).

A relay listens on a local port and forwards each connection to its target, both ways,
delaying every chunk by half the link's RTT and pacing it to the link's bandwidth (a
serialisation queue, as a real link has). `ember up` starts one relay process for the
whole cluster (`python -m ember.cluster.wan --spec FILE`) and points every inter-site hop
through its relay: router -> remote prefill/decode, kvstore -> remote kvstore (gRPC and
data plane). Same-site traffic never crosses a relay.

Spec (JSON): [{"listen": "127.0.0.1:P", "target": "127.0.0.1:Q", "rtt_ms": 40, "gbps": 1.0}, ...]

Faults (the chaos harness): with `--faults FILE`, the relay re-reads FILE (JSON, {listen: mode})
every 0.1 s and applies each link's mode to its connections, live ones included:
- "reset": every connection is closed at once and new ones are refused (closed on accept);
- "blackhole": bytes are accepted and dropped, nothing arrives (a peer that never answers);
- "stall": bytes are held until the mode changes, then delivered (a frozen peer that recovers);
- "slow": the link runs at 1/100 of its bandwidth;
- "none" (or absent): the link as specified.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 64 * 1024


FAULTS = ("none", "reset", "blackhole", "stall", "slow")
SLOW_FACTOR = 100
RELAY_NICE = 10


@dataclass(frozen=True)
class Relay:
    listen: str
    target: str
    rtt_ms: float
    gbps: float


class LinkState:
    """A link's fault mode, and its open connections (closed on reset)."""

    def __init__(self):
        self.mode = "none"
        self.writers: set[asyncio.StreamWriter] = set()
        self.changed = asyncio.Event()

    def set(self, mode: str) -> None:
        if mode not in FAULTS:
            raise ValueError(f"fault mode must be one of {FAULTS}, got {mode!r}")
        if mode == self.mode:
            return
        self.mode = mode
        self.changed.set()
        self.changed = asyncio.Event()
        if mode == "reset":
            for w in list(self.writers):
                w.transport.abort()  # an RST, not a clean close
            self.writers.clear()


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
                bytes_per_s: float, state: LinkState | None = None) -> None:
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
            while state is not None and state.mode == "stall":
                await state.changed.wait()
            if state is not None and state.mode in ("blackhole", "reset"):
                continue  # dropped on the wire
            writer.write(data)
            await writer.drain()
    sender = loop.create_task(deliver())
    wire_free = loop.time()
    try:
        while data := await reader.read(_CHUNK):
            rate = bytes_per_s / SLOW_FACTOR if state is not None and state.mode == "slow" else bytes_per_s
            wire_free = max(loop.time(), wire_free) + len(data) / rate
            await queue.put((wire_free + delay_s, data))
    except ConnectionError:
        pass
    finally:
        await queue.put((0.0, None))
        try:
            await sender
        except ConnectionError:
            pass


async def serve(relays: list[Relay], states: dict[str, LinkState] | None = None) -> list[asyncio.AbstractServer]:
    """Start the relays; `states` (filled here, by listen address) holds each link's fault mode."""
    servers = []
    states = {} if states is None else states
    for relay in relays:
        state = states.setdefault(relay.listen, LinkState())

        async def handle(reader, writer, relay=relay, state=state):
            if state.mode == "reset":
                writer.transport.abort()
                return
            host, port = relay.target.rsplit(":", 1)
            try:
                up_reader, up_writer = await asyncio.open_connection(host, int(port))
            except OSError:
                writer.close()
                return
            state.writers.update((writer, up_writer))
            delay, rate = relay.rtt_ms / 2e3, relay.gbps * 1e9 / 8
            await asyncio.gather(_pump(reader, up_writer, delay, rate, state),
                                 _pump(up_reader, writer, delay, rate, state), return_exceptions=True)
            state.writers.difference_update((writer, up_writer))
        host, port = relay.listen.rsplit(":", 1)
        servers.append(await asyncio.start_server(handle, host, int(port)))
    return servers


def main() -> None:
    p = argparse.ArgumentParser(prog="ember.cluster.wan")
    p.add_argument("--spec", required=True, help="JSON list of relays")
    p.add_argument("--faults", help="JSON file {listen address: fault mode}, re-read every 0.1 s")
    args = p.parse_args()
    relays = [Relay(**r) for r in json.loads(open(args.spec).read())]
    # a real link costs the hosts at its ends nothing: on one machine, the relay's copying yields
    # to the engines (its pacing is by the clock, so its delays hold while it waits its turn)
    os.nice(RELAY_NICE)

    async def run():
        states: dict[str, LinkState] = {}
        await serve(relays, states)
        print(f"{time.strftime('%H:%M:%S')} relaying {len(relays)} emulated links", flush=True)
        while True:
            await asyncio.sleep(0.1)
            if args.faults:
                apply_faults(args.faults, states)
    import uvloop
    uvloop.run(run())


def apply_faults(path: str, states: dict[str, LinkState]) -> None:
    """Set every relay's mode from `path`; once a new content is in force, say so in PATH.applied (the
    same text: ember.cluster.chaos.Cluster.set_faults waits for it)."""
    try:
        text = open(path).read()
        wanted = json.loads(text)
    except (OSError, ValueError):
        return  # absent or half-written: keep the modes as they are
    for listen, state in states.items():
        state.set(wanted.get(listen, "none"))
    applied = Path(path + ".applied")
    if not applied.exists() or applied.read_text() != text:
        applied.with_suffix(".tmp").write_text(text)
        applied.with_suffix(".tmp").replace(applied)


if __name__ == "__main__":
    main()
