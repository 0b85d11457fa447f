"""Server bootstrap shared by every service: aio server on uvloop, health, reflection,
message limits, graceful SIGTERM drain."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ember.rpc import cert_reload, logs, security, tracing
from ember.rpc.authz import AuthzInterceptor
from ember.rpc.drain import DrainGate
from ember.rpc.errors import ErrorInterceptor

MAX_MESSAGE_BYTES = 64 * 2**20
# Keepalive pings on every channel and from every server: a peer that accepts bytes but never
# answers (blackholed) fails its calls with UNAVAILABLE after KEEPALIVE_S + KEEPALIVE_TIMEOUT_S
# (client side) or SERVER_KEEPALIVE_S + KEEPALIVE_TIMEOUT_S (a server drops a vanished client's
# calls). gRPC core bounds an unanswered ping by `grpc.http2.ping_timeout_ms` (default 60 s), not
# by keepalive_timeout_ms: both are set. tests/test_liveness.py measures the bounds.
KEEPALIVE_S, KEEPALIVE_TIMEOUT_S, SERVER_KEEPALIVE_S = 5, 5, 10
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that comes back is reconnected within a second: gRPC's default backoff grows to
    # 120 s, so a worker restarted after 30 s down stayed unseen for another ~10 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_S * 1000),  # the server pings its clients too
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),  # accept our clients' pings
    ("grpc.http2.max_ping_strikes", 0),
]
# A call that arrives without a deadline gets this one for the work it fans out (no hop waits forever).
DEFAULT_DEADLINE_S = 600.0


def remaining(context, default_s: float = DEFAULT_DEADLINE_S) -> float:
    """The caller's time left for a downstream call: its deadline, or the default when it set none."""
    left = context.time_remaining()
    return default_s if left is None else left


def bind_address(address: str) -> str:
    """Where to listen for `address`. With EMBER_BIND_HOST set (Kubernetes: 0.0.0.0) a service
    listens there on the same port while the config keeps the name others dial (a Service)."""
    host = os.environ.get("EMBER_BIND_HOST")
    return f"{host}:{address.rsplit(':', 1)[1]}" if host else address


def channel(address: str) -> grpc.aio.Channel:
    """A client channel to another service of the cluster: mTLS with this process's certificate
    (plaintext only when none is installed), carrying the trace context of the calling request
    (a CLIENT span per call)."""
    creds = security.current()
    if creds is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                         interceptors=tracing.client_interceptors())
    return grpc.aio.secure_channel(address, creds.channel_credentials(), options=CHANNEL_OPTIONS,
                                   interceptors=tracing.client_interceptors())


class Server:
    """One gRPC server: NOT_SERVING until warm, SERVING, then a drain on SIGTERM (`run`)."""

    # A draining server says NOT_SERVING this long before it refuses new calls: two of the
    # router's health polls (services/router/workers.py). EMBER_DRAIN_NOTICE_S overrides it.
    DRAIN_NOTICE_S = 1.0

    def __init__(self, address: str, service_names: list[str], public: bool = False, reflection_on: bool = True,
                 internal: str | None = None, public_tls: cert_reload.CertSource | None = None,
                 interceptors: list | None = None):
        """An internal server listens on `address` with mTLS when this process has credentials
        (ember.rpc.security) and authorizes each call by the caller's role (ember.rpc.authz). A
        `public` one (the router's API) listens on `address` with server TLS when `public_tls` is
        given (no client certificate asked; API keys guard it), else in plaintext, and with mTLS on
        `internal`, where cluster services reach it. Certificates are re-read without a restart
        (ember.rpc.cert_reload). `interceptors`: innermost, after authorization."""
        self.address = address
        self.service_names = service_names
        creds = security.current()
        # the SERVER span first, so the error interceptor's status lands on it; authorization inside
        # (by certificate: nothing to check without credentials, `security: {tls: plaintext}`)
        # (the drain's gate outermost: a call refused while draining costs nothing more)
        self.gate = DrainGate()
        interceptors = [self.gate, tracing.server_interceptor(), ErrorInterceptor()] + (
            [AuthzInterceptor()] if creds else []) + list(interceptors or [])
        self.server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection_on:
            reflection.enable_server_reflection(service_names + [reflection.SERVICE_NAME, health.SERVICE_NAME],
                                                self.server)
        internal_tls = cert_reload.watch_installed() if creds is not None else None
        for listen, tls in ((address, public_tls if public else internal_tls), (internal, internal_tls)):
            if listen is None:
                continue
            if tls is not None:
                bound = self.server.add_secure_port(bind_address(listen), cert_reload.watch(tls).grpc_credentials())
            else:
                bound = self.server.add_insecure_port(bind_address(listen))
            if bound == 0:
                raise OSError(f"cannot listen on {listen}")

    async def set_status(self, status) -> None:
        for name in self.service_names + [""]:
            await self.health.set(name, status)

    async def run(self, warmup: Callable[[], Awaitable[None]] | None = None, grace_s: float = 10.0,
                  on_stop: Callable[[], Awaitable[None]] | None = None, notice_s: float | None = None) -> None:
        """Serve until SIGTERM/SIGINT, then drain: health says NOT_SERVING at once while calls are
        still served for `notice_s` (health pollers such as the router, every 0.5 s, move away
        first; a second signal cuts it short), then new calls are refused and running ones get
        `grace_s` to finish; `on_stop` runs and the process exits 0."""
        log = logging.getLogger("ember")
        if notice_s is None:
            notice_s = float(os.environ.get("EMBER_DRAIN_NOTICE_S", self.DRAIN_NOTICE_S))
        # certificates: re-read on SIGHUP and when their files change (new handshakes get them)
        reloading = asyncio.create_task(cert_reload.run())
        await self.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if warmup is not None:
            await warmup()
        await self.set_status(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s", ",".join(self.service_names), self.address)
        signals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        sig = await signals.get()
        reloading.cancel()
        # drain: NOT_SERVING for good (nothing sets SERVING again), still serving for the notice
        await self.health.enter_graceful_shutdown()
        log.info("draining on %s: NOT_SERVING now, new calls refused in %g s, running calls get %g s more",
                 signal.Signals(sig).name, notice_s, grace_s)
        if notice_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(signals.get(), notice_s)
        # new calls refused (UNAVAILABLE, by the gate) while the running ones finish; gRPC stops after
        self.gate.close()
        started = time.monotonic()
        if not await self.gate.idle(grace_s):
            log.warning("drain: %d calls still running after %g s are cut", self.gate.running, grace_s)
        # what the gate never saw (a request still arriving when it closed) gets the rest, up to a
        # second: a health Watch or reflection stream a client holds open must not hold the exit
        await self.server.stop(min(1.0, max(0.0, grace_s - (time.monotonic() - started))))
        if on_stop is not None:
            await on_stop()
        log.info("drained: %s stopped", ",".join(self.service_names))


def run_service(main: Callable[[], Awaitable[None]], name: str) -> None:
    """Entry point helper: logging, tracing, uvloop, run."""
    import uvloop
    logs.setup(name)
    tracing.setup(name)
    uvloop.run(main())
