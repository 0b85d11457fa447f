"""A cluster's services started one at a time, each with an environment of its own: one machine
emulating hosts that differ (an edge host whose model cache is empty: `EMBER_CACHE_DIR`), and a worker
started late to time its start. The run folder is laid out as `ember up` lays it out (pids.json,
services.json, certs/, links.json), so `ember.cluster.chaos.Cluster` (faults on the links relay,
restarts) and `ember.cluster.launcher.down` work on it."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from ember.cluster.launcher import credentials, metrics_endpoint, service_commands, spawn, tls_env, wait_serving
from ember.config.load import load_config
from ember.config.services import services


class Staged:
    def __init__(self, config_path: str | Path, run_dir: str | Path):
        self.config_path, self.run_dir = Path(config_path).resolve(), Path(run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config = load_config(self.config_path)
        self.commands = service_commands(self.config, self.config_path, self.run_dir)
        if self.config.security.tls == "auto":
            from ember.cluster.certs import write_cluster_certs
            shutil.rmtree(self.run_dir / "certs", ignore_errors=True)
            write_cluster_certs(self.config, self.run_dir / "certs")
        self.specs = {svc.name: svc for svc in services(self.config)}
        self.procs: dict[str, subprocess.Popen] = {}
        self._services: dict[str, dict] = {}

    def start(self, name: str, env: dict[str, str] | None = None, timeout_s: float = 300, wait: bool = True
              ) -> subprocess.Popen:
        """Start service `name` (or "links", the relay) with `env` on top of the cluster's; by default
        wait until it serves."""
        argv, address = self.commands[name]
        full_env = {**(env or {}), **tls_env(self.config, self.run_dir, name)}
        proc = spawn(self.run_dir, name, argv, full_env)
        self.procs[name] = proc
        spec = self.specs.get(name)
        self._services[name] = {"address": address, "role": spec.role if spec else name,
                                "site": spec.site if spec else None,
                                "metrics": metrics_endpoint(self.config, self.run_dir, name, argv), "argv": argv,
                                "env": full_env}
        self._record()
        if wait:
            self.wait_serving(name, timeout_s)
        return proc

    def wait_serving(self, name: str, timeout_s: float = 300) -> None:
        address = self.commands[name][1]
        if address is not None:
            wait_serving(address, time.monotonic() + timeout_s, self.procs[name], self.run_dir / f"{name}.log",
                         None if name == "router" else credentials(self.run_dir))

    def stop(self, name: str, grace_s: float = 10) -> None:
        proc = self.procs.pop(name)
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        self._services.pop(name, None)
        self._record()

    def _record(self) -> None:
        for file, body in (("pids.json", {n: p.pid for n, p in self.procs.items()}),
                           ("services.json", self._services)):
            tmp = self.run_dir / (file + ".tmp")
            tmp.write_text(json.dumps(body, indent=1))
            tmp.replace(self.run_dir / file)

    def close(self) -> None:
        from ember.cluster.launcher import down
        down(self.run_dir)
        self.procs.clear()
