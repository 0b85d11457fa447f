"""`ember up` / `ember down`: the local cluster as separate processes.

Each service runs as `python -m ember.services.<role> --config FILE [--site SITE]` (the
installed package; no PYTHONPATH, any working directory) in its own session (it outlives the
`ember up` command), logging to RUN_DIR/<name>.log; pids go to RUN_DIR/pids.json. `up` fetches a
named model into the user cache if absent and returns once every service reports SERVING on
grpc.health.v1.

With `security.tls: auto` (the default) `up` first makes a fresh CA and one certificate per
service under RUN_DIR/certs (ember.cluster.certs) and starts each service with EMBER_TLS_DIR
naming its folder; RUN_DIR/certs/operator is what `ember status`, benchmarks and tests dial with.
With `router.tls: auto` it also makes the router's public server certificate (RUN_DIR/certs/router-public,
EMBER_ROUTER_TLS_DIR) from that CA; clients of the public ports trust RUN_DIR/certs/ca.crt (`router_ca`,
recorded as the router's `ca` in services.json).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from platformdirs import user_state_path

from ember.cluster.ports import free_port
from ember.config.load import load_config
from ember.config.schema import ClusterConfig
from ember.config.services import services
from ember.rpc import security


def default_config() -> Path:
    """The shipped local cluster (configs/local.yaml, installed as ember.configs)."""
    return Path(str(files("ember.configs") / "local.yaml"))


def default_run_dir() -> Path:
    """Where `ember up` keeps logs and pids unless told: $EMBER_STATE_DIR/runs/local, else the
    user state folder (~/.local/state/ember/runs/local on Linux)."""
    root = os.environ.get("EMBER_STATE_DIR")
    return (Path(root) if root else user_state_path("ember", appauthor=False)) / "runs" / "local"


class _Ports:
    """Free loopback ports, never one the config uses or one handed out already (the OS can
    give back a just-probed port)."""

    def __init__(self, config: ClusterConfig):
        addresses = [config.router.listen, config.router.http, config.router.internal] + [
            a for s in config.sites for a in [s.kvstore, s.kvstore_data, *s.prefill, *s.decode]]
        self.taken = {int(a.rsplit(":", 1)[1]) for a in addresses if a}

    def address(self) -> str:
        while (port := free_port()) in self.taken:
            pass
        self.taken.add(port)
        return f"127.0.0.1:{port}"


def emulated_links(config: ClusterConfig, ports: _Ports | None = None) -> tuple[list[dict], dict[str, list[str]]]:
    """Relays for every inter-site hop, and the `--route` arguments of each process that uses
    them: {"router": [...], "kvstore-<site>": [...]}. Empty unless placement.emulate_links is set."""
    relays, routes = [], {"router": []}
    if not config.placement.emulate_links:
        return relays, routes
    ports = ports or _Ports(config)

    def relay(src: str, dst: str, target: str, user: str) -> None:
        link = config.link(src, dst)
        if link is None or target is None:
            return
        listen = ports.address()
        relays.append({"listen": listen, "target": target, "rtt_ms": link.rtt_ms, "gbps": link.bandwidth_gbps})
        routes.setdefault(user, []).append(f"{target}={listen}")
    prefill_workers = [s for s in services(config) if s.role == "prefill"]
    for site in config.sites:
        for worker in site.prefill + site.decode:
            relay(config.router.site, site.name, worker, "router")
        for peer in config.sites:  # a prefill worker at `site` streaming KV to `peer`'s kvstore
            if peer.name != site.name and peer.has("kvstore"):
                for worker in (w for w in prefill_workers if w.site == site.name):
                    relay(site.name, peer.name, peer.kvstore, worker.name)
        for peer in config.sites:  # kvstore at `site` pulling from `peer`
            if peer.name != site.name and site.has("kvstore"):
                relay(site.name, peer.name, peer.kvstore, f"kvstore-{site.name}")
                relay(site.name, peer.name, peer.kvstore_data, f"kvstore-{site.name}")
    return relays, routes


def service_commands(config: ClusterConfig, config_path: Path, run_dir: Path | None = None
                     ) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, address) for every process of the cluster (address None: not gRPC)."""
    py, cfg = sys.executable, str(config_path)
    commands = {}
    ports = _Ports(config)
    relays, routes = emulated_links(config, ports)
    if relays:
        spec = (run_dir or config_path.parent) / "links.json"
        spec.write_text(json.dumps(relays, indent=1))
        commands["links"] = ([py, "-m", "ember.cluster.wan", "--spec", str(spec),  # faults.json: the chaos harness
                              "--faults", str(spec.parent / "faults.json")], None)
    if any(svc.role in ("prefill", "decode") for svc in services(config)):  # engine cores fork from it
        commands[TEMPLATE] = ([py, "-m", "ember.serving.template", "--socket", template_socket(run_dir or
                                                                                             config_path.parent)], None)
    for svc in services(config):
        argv = [py, "-m", f"ember.services.{svc.role}", "--config", cfg, *svc.args()]
        argv += [a for r in routes.get(svc.name, []) for a in ("--route", r)]
        argv += ["--metrics-listen", ports.address()]  # every gRPC service also serves Prometheus /metrics
        commands[svc.name] = (argv, svc.address)
    return commands


TEMPLATE = "engine-template"


def template_socket(run_dir: Path) -> str:
    """The engine template's socket (abstract namespace: no file to go stale, no path-length limit)."""
    return "@ember-engine-template-" + hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def service_extra_env(config: ClusterConfig, run_dir: Path, name: str, commands: dict) -> dict[str, str]:
    """What service `name` runs with beyond service_env: its certificate folder; an engine service,
    the engine template to fork its core from."""
    env = tls_env(config, run_dir, name)
    if name == "router" and config.router.tls == "auto":  # its public ports' certificate (ember.cluster.certs)
        env["EMBER_ROUTER_TLS_DIR"] = str(run_dir / "certs" / "router-public")
    if TEMPLATE in commands and name.startswith(("prefill", "decode")):
        env["EMBER_ENGINE_TEMPLATE"] = template_socket(run_dir)
    return env


def prepare_model(config: ClusterConfig) -> Path:
    """The model's file, fetched into the user cache when it is a named model not there yet, and
    a GGUF converted once here (not racing in two engine processes), with its packed int4 weights."""
    from ember.model.fetch import MODELS, fetch_model
    from ember.model.files import prepare_gguf
    model = config.model_path()
    if config.model in MODELS:
        fetch_model(config.model, model)
    if not model.exists():
        raise FileNotFoundError(f"model not found: {model} (from `model: {config.model}` in the config)")
    if model.suffix == ".gguf":
        prepare_gguf(model)
    else:  # an unserved checkpoint format (its quantization_config) refused before any process starts
        from ember.model.files import resolve_serving
        resolve_serving(model, config.engine.dtype, config.engine.weights)
    return model


def tls_env(config: ClusterConfig, run_dir: Path, name: str) -> dict[str, str]:
    """The environment service `name` needs for its certificate: EMBER_TLS_DIR in auto mode."""
    return {"EMBER_TLS_DIR": str(run_dir / "certs" / name)} if config.security.tls == "auto" else {}


def router_ca(config: ClusterConfig, run_dir: Path) -> str | None:
    """The CA file clients of the router's public ports trust (router.tls), None when they are plaintext."""
    from ember.config.services import router_settings
    if config.router.tls is None:
        return None
    return str(run_dir / "certs" / "ca.crt") if config.router.tls == "auto" else router_settings(config).tls_ca


def metrics_endpoint(config: ClusterConfig, run_dir: Path, name: str, argv: list[str]) -> dict | None:
    """services.json's "metrics" of service `name` (its command line `argv`): where its /metrics is and
    how the operator reads it (ember.rpc.metrics_http.endpoint); None when it serves none."""
    if "--metrics-listen" not in argv:
        return None
    from ember.config.services import security_settings
    from ember.rpc import metrics_http
    access = metrics_http.access_of(security_settings(config, name, env=tls_env(config, run_dir, name)))
    operator = security_settings(config, "operator", env=tls_env(config, run_dir, "operator")).tls_dir
    return metrics_http.endpoint(argv[argv.index("--metrics-listen") + 1], access, operator)


def credentials(run_dir: str | Path | None = None, name: str = "operator") -> security.Credentials | None:
    """The certificate `name` (operator: CLI tools and tests) holds in a running cluster's run
    folder, or None when the cluster runs plaintext (or with mounted certificates elsewhere)."""
    folder = Path(run_dir or default_run_dir()) / "certs" / name
    return security.Credentials.load(folder) if (folder / "tls.crt").is_file() else None


def service_env(run_dir: Path) -> dict[str, str]:
    """The environment every service of a local cluster runs with (before its certificate folder)."""
    env = dict(os.environ)
    env.pop("EMBER_OMP_PASSIVE", None)  # the cluster's processes share cores: they always wait passively
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("EMBER_LOG_FORMAT", "json")  # one JSON object per line, with request ids
    if not env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        env.setdefault("EMBER_TRACE_DIR", str(run_dir))  # spans as JSON lines beside the logs
    return env


# Every service process this process started (pid -> Popen), so that its exit code can be read
# (ember.cluster.chaos.Cluster.wait_exit) and no one else's poll reaps it first.
_children: dict[int, subprocess.Popen] = {}


def spawn(run_dir: Path, name: str, argv: list[str], extra_env: dict[str, str]) -> subprocess.Popen:
    """Start service `name` of the cluster in `run_dir` in its own session (it outlives its starter),
    appending to RUN_DIR/<name>.log."""
    with open(run_dir / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir,
                                env={**service_env(run_dir), **extra_env}, start_new_session=True)
    _children[proc.pid] = proc
    return proc


def child(pid: int) -> subprocess.Popen | None:
    """The Popen of a service this process spawned, by pid (None: someone else's)."""
    return _children.get(pid)


def wait_serving(address: str, deadline: float, proc: subprocess.Popen, log_path: Path,
                 creds: security.Credentials | None = None, public_ca: str | None = None) -> None:
    """Until the service at `address` answers SERVING: over mTLS with `creds`, over TLS trusting the
    CA file `public_ca` (the router's public port with router.tls), else plaintext."""
    from ember.client import router_channel
    # reconnect every 50 ms: gRPC's default backoff (1 s, then 1.6x) kept a service that had just
    # started listening unseen for up to a second or two
    fast = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 50)]
    with (router_channel(address, public_ca, fast) if public_ca else security.dial(address, creds, options=fast)
          ) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text()[-2000:] if log_path.exists() else ""
                raise RuntimeError(f"{log_path.stem} exited with code {proc.returncode}:\n{tail}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{log_path.stem} at {address} not serving in time; see {log_path}")
            time.sleep(0.05)  # (a health check is ~1 ms: a start is not rounded up to 0.2 s)


def up(config_path: str | Path | None = None, run_dir: str | Path | None = None,
       timeout_s: float = 300, env: dict[str, str] | None = None) -> ClusterConfig:
    """Start the cluster of `config_path` (see the module's docstring). `env`: variables every service
    gets on top of this process's environment (kept in services.json: a restart gets them too)."""
    config_path = Path(config_path or default_config()).resolve()
    run_dir = Path(run_dir or default_run_dir()).resolve()
    config = load_config(config_path)
    prepare_model(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "pids.json").exists():
        down(run_dir)
    procs: dict[str, subprocess.Popen] = {}
    commands = service_commands(config, config_path, run_dir)
    try:
        if TEMPLATE in commands:  # first: its imports are the longest part of an engine's start; no certificate
            procs[TEMPLATE] = spawn(run_dir, TEMPLATE, commands[TEMPLATE][0], env or {})
            (run_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in procs.items()}))
        if config.security.tls == "auto":  # a throwaway CA per run: nothing of an earlier run is trusted
            from ember.cluster.certs import write_cluster_certs
            shutil.rmtree(run_dir / "certs", ignore_errors=True)
            write_cluster_certs(config, run_dir / "certs")  # (the router's public one too, with router.tls: auto)
        elif config.router.tls == "auto":  # internal hops not `auto`: a CA of this run for the public port only
            from ember.cluster.certs import write_router_public
            shutil.rmtree(run_dir / "certs", ignore_errors=True)
            write_router_public(config, run_dir / "certs")
        for name, (argv, _) in commands.items():
            if name in procs:
                continue
            procs[name] = spawn(run_dir, name, argv, {**(env or {}), **service_extra_env(config, run_dir, name,
                                                                                        commands)})
            (run_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in procs.items()}))
        specs = {svc.name: svc for svc in services(config)}
        public_ca = router_ca(config, run_dir)
        (run_dir / "services.json").write_text(json.dumps(  # for `ember status`, restarts and tests
            {n: {"address": a, "role": specs[n].role if n in specs else n,
                 "site": specs[n].site if n in specs else None, **({"ca": public_ca} if n == "router" else {}),
                 "metrics": metrics_endpoint(config, run_dir, n, argv),
                 "argv": argv, "env": {**(env or {}), **service_extra_env(config, run_dir, n, commands)}}
             for n, (argv, a) in commands.items()}, indent=1))
        deadline = time.monotonic() + timeout_s
        creds = credentials(run_dir)
        for name, (_, address) in commands.items():
            if address is not None:
                wait_serving(address, deadline, procs[name], run_dir / f"{name}.log",  # the router's: its public port
                             None if name == "router" else creds, public_ca if name == "router" else None)
        wait_router_counts_live(run_dir, deadline)
    except BaseException:
        down(run_dir)
        raise
    return config


def wait_router_counts_live(run_dir: Path, deadline: float) -> None:
    """Until the router counts every engine worker live (its health poll, every 0.5 s, has seen each
    SERVING): a cluster `ember up` returns serves its first request as configured, not on a
    fallback (a prefill worker the router has not seen yet sends the request to decode-only)."""
    from ember.cluster.status import scrape
    services_ = json.loads((run_dir / "services.json").read_text())
    router = services_.get("router", {}).get("metrics")
    keys = [f'ember:worker_live{{address="{s["address"]}",role="{s["role"]}",site="{s["site"]}"}}'
            for s in services_.values() if s.get("role") in ("prefill", "decode")]
    if router is None or not keys:
        return
    while not all((seen := scrape(router)).get(k) == 1.0 for k in keys):
        if time.monotonic() > deadline:
            missing = [k for k in keys if seen.get(k) != 1.0]
            raise TimeoutError(f"the router never counted these workers live: {missing}")
        time.sleep(0.05)


@contextmanager
def running(config_path: str | Path | None, run_dir: str | Path | None,
            timeout_s: float = 300) -> Iterator[ClusterConfig]:
    """The cluster of `config_path`, up for the `with` block and stopped after it, whatever happens."""
    config = up(config_path, run_dir, timeout_s)
    try:
        yield config
    finally:
        down(run_dir)


def down(run_dir: str | Path | None = None, grace_s: float = 15) -> list[str]:
    """SIGTERM every process of the cluster (they drain), SIGKILL what is left after grace_s."""
    pid_file = Path(run_dir or default_run_dir()) / "pids.json"
    if not pid_file.exists():
        return []
    pids = json.loads(pid_file.read_text())
    for pid in pids.values():
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids.values()):
        time.sleep(0.1)
    for pid in pids.values():
        _signal(pid, signal.SIGKILL)
        if (proc := _children.pop(pid, None)) is not None:
            proc.wait(timeout=10)
    pid_file.unlink(missing_ok=True)  # (two `ember down`s at once: the other may have removed it)
    return list(pids)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    if (proc := _children.get(pid)) is not None:
        return proc.poll() is None
    try:
        finished, _ = os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        if finished:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
