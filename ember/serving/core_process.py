"""The engine core's own process: `python -m ember.serving.core_process --fd N --config JSON`.

Started by `SubprocessEngineClient`; talks to it over the socketpair end `--fd`. The model
loop runs on this process's main thread; the KV connector (when `--kvstore` is given) does
its I/O on a thread of its own. The process exits when its service closes the socket,
dies, or sends ("shutdown",).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from multiprocessing.connection import Connection

START = time.monotonic()

def exit_with_service(fd: int) -> None:
    """Exit as soon as the service's end of socket `fd` closes (its death, a SIGKILL included): the
    closed socket is otherwise only seen between steps, and a long prefill would compute on for
    nobody, on cores the surviving workers need. A thread polling the socket for its peer's hang-up
    (POLLRDHUP), not the parent's pid: a core forked by the engine template is not its service's
    child; nor PR_SET_PDEATHSIG, which fires when the spawning *thread* ends."""
    import select
    import threading

    def watch():
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        while True:
            for _, events in poller.poll():
                if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    os._exit(0)
    threading.Thread(target=watch, name="exit-with-service", daemon=True).start()


def hold_ready_until_exists(gate: str | None) -> None:
    """A test's hold on a warm core (EMBER_TEST_CORE_READY_GATE=PATH): it says ready only once PATH
    exists, so a worker's not-yet-warm phase can be watched however fast this host loads a model."""
    while gate and not os.path.exists(gate):
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember.serving.core_process")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    p.add_argument("--kvstore", help="the site kvstore's gRPC address (L2, KV transfers)")
    p.add_argument("--no-shm", action="store_true", help="read frames over gRPC even on the same host")
    p.add_argument("--tls-dir", help="the service's TLS folder (ember.rpc.security): mTLS to the kvstore")
    p.add_argument("--unsigned-kv", action="store_true",
                   help="the config's `security: {kv_mac: off}`: run without kv-mac.key (else its absence fails)")
    p.add_argument("--route", action="append", default=[], metavar="ADDRESS=RELAY",
                   help="reach another site's kvstore ADDRESS through RELAY (an emulated link)")
    p.add_argument("--trace-service", help="the service's name: this core's spans are its (ember.rpc.tracing)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the service, which shuts us down
    exit_with_service(args.fd)
    conn = Connection(args.fd)

    from ember.rpc import logs
    logs.setup("engine-core")
    if args.trace_service and (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("EMBER_TRACE_DIR")):
        from ember.rpc import tracing  # each request's spans here join its trace (ember.serving.core_spans)
        tracing.setup(args.trace_service, "engine-core")
    phases = [("started", time.monotonic())]
    try:
        values = json.loads(args.config)  # (what is wrong with the command line fails before the imports)
        if args.tls_dir:  # fails closed on a missing kv-mac.key, as its service did (unless opted out)
            from ember.rpc import security
            security.install(security.require_kv_mac(security.Credentials.load(args.tls_dir),
                                                     "off" if args.unsigned_kv else "required"))
        from ember.engine.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.serving.engine_core import EngineCore
        from ember.serving.messages import CoreInfo
        phases.append(("imports", time.monotonic()))
        if args.kvstore:  # a model missing here (an empty cache) is fetched through the site kvstore first
            from ember.rpc import model_fetch, security
            model_fetch.ensure_model_file(values["model"], args.kvstore, security.current())
            phases.append(("model fetch", time.monotonic()))
        engine = LLMEngine(EngineConfig(**values))  # (pinned to engine.cpus, if set)
        phases.append(("engine", time.monotonic()))
        connector = None
        if args.kvstore:
            from ember.rpc import security
            from ember.rpc.kv_connector import KVConnector
            creds = security.current()  # the KV frame MAC key is read here, at the edge, and passed down
            from ember.cluster.wan import parse_routes
            connector = KVConnector(args.kvstore, engine.frame_template, use_shm=not args.no_shm,
                                    mac_key=creds.mac_key if creds is not None else None,
                                    routes=parse_routes(args.route))
        core = EngineCore(engine, connector)
        info = CoreInfo(os.getpid(), engine.config.block_size, engine.block_manager.root_hash,
                        engine.loaded.args.vocab_size, engine.max_model_len, list(engine.kernels), core.memory())
    except Exception as e:  # noqa: BLE001 - reported to the service, which fails its start-up
        import traceback  # the whole traceback goes to the service's log; users see the one line
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return 1
    phases.append(("connector", time.monotonic()))
    hold_ready_until_exists(os.environ.get("EMBER_TEST_CORE_READY_GATE"))
    conn.send(("ready", info))
    engine.grammars.prepare()  # (~0.3 s on a thread, after ready: not in the start, nor in a first constrained step)
    logging.getLogger("ember.engine").info(
        "engine core ready in %.2f s since its process started (%s)", phases[-1][1] - START,
        ", ".join(f"{name} {t - before:.2f} s" for (name, t), (_, before) in zip(phases, [("", START), *phases])))
    from ember.serving.engine_client import serve_loop
    from ember.serving.engine_core import error_info

    def receive(timeout):
        messages = []
        try:
            while conn.poll(timeout):
                messages.append(conn.recv())
                timeout = 0
        except (EOFError, OSError):
            messages.append(("shutdown",))  # the service is gone
        return messages

    def emit(events, snapshot):
        events = [("error", e[1], error_info(e[2])) if e[0] == "error" else e for e in events]
        try:
            conn.send((events, snapshot))
        except OSError:
            pass  # the service is gone; the next receive ends the loop
    serve_loop(core, receive, emit)
    if connector is not None:
        connector.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
