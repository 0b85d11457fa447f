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
from multiprocessing.connection import Connection

PARENT_POLL_S = 0.2


def exit_with_parent() -> None:
    """Exit within PARENT_POLL_S of the service's death (a SIGKILL included): the closed socket
    is only seen between steps, and a long prefill would compute on for nobody, on cores the
    surviving workers need. A thread, not PR_SET_PDEATHSIG: that fires when the spawning
    *thread* ends, which need not be the service's end."""
    import threading
    import time
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember.serving.core_process")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig fields as JSON")
    p.add_argument("--kvstore", help="the site kvstore's gRPC address (L2, KV transfers)")
    p.add_argument("--no-shm", action="store_true", help="read frames over gRPC even on the same host")
    p.add_argument("--tls-dir", help="the service's TLS folder (ember.rpc.security): mTLS to the kvstore")
    p.add_argument("--route", action="append", default=[], metavar="ADDRESS=RELAY",
                   help="reach another site's kvstore ADDRESS through RELAY (an emulated link)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the service, which shuts us down
    exit_with_parent()
    conn = Connection(args.fd)

    from ember.rpc import logs
    logs.setup("engine-core")
    try:
        from ember.engine.config import EngineConfig
        from ember.engine.engine import LLMEngine
        from ember.serving.engine_core import EngineCore
        from ember.serving.messages import CoreInfo
        if args.tls_dir:
            from ember.rpc import security
            security.install(security.Credentials.load(args.tls_dir))
        values = json.loads(args.config)
        if args.kvstore:  # a model missing here (an empty cache) is fetched through the site kvstore first
            from ember.rpc import model_fetch, security
            model_fetch.ensure_model_file(values["model"], args.kvstore, security.current())
        engine = LLMEngine(EngineConfig(**values))  # (pinned to engine.cpus, if set)
        engine.grammars.tokenizer  # noqa: B018 - prepared now (~0.3 s), not in the batch of the first constrained request
        connector = None
        if args.kvstore:
            from ember.rpc import security
            from ember.rpc.kv_connector import KVConnector
            creds = security.current()  # the KV frame MAC key is read here, at the edge, and passed down
            if creds is not None and creds.mac_key is None:
                logging.getLogger("ember.engine").warning(
                    "%s holds no kv-mac.key: KV frames go unsigned and are imported unchecked", creds.folder)
            from ember.cluster.wan import parse_routes
            connector = KVConnector(args.kvstore, engine.frame_template, use_shm=not args.no_shm,
                                    mac_key=creds.mac_key if creds is not None else None,
                                    routes=parse_routes(args.route))
        core = EngineCore(engine, connector)
        info = CoreInfo(os.getpid(), engine.config.block_size, engine.block_manager.root_hash,
                        engine.loaded.args.vocab_size, engine.max_model_len, list(engine.kernels))
    except Exception as e:  # noqa: BLE001 - reported to the service, which fails its start-up
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", info))
    conn.send(([], core.snapshot()))  # the gauges (its memory among them) before any request
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
