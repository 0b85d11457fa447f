"""The suite's session clusters, one per config, each started once.

A module asks for a cluster by fixture (conftest: `exact_cluster`, `default_cluster`, `ha_cluster`)
and gets it after a reset that proves it is back in its start state (ember.cluster.chaos.Cluster.reset:
every service up, every worker live at the router, nothing running, no block used at decode, no
lease), so a module that kills or drains a service hands the next one a whole cluster. conftest
orders the test items so that the modules of one config run together, and the pool stops a
cluster when the suite moves on to the next: one cluster is up at a time (each holds GBs).

Configs:
- exact: the two-site cluster of tests/cluster_fixture.write_config, fp32 dense weights, whose
  tokens are checked against transformers;
- default: the shipped configs/local.yaml on free ports (the GGUF's Q4_1 codes, as users run it), its
  prefill always at the prefill worker (placement.shared_host: disaggregated);
- ha: the shipped configs/local-ha.yaml on free ports (two prefill, two decode workers).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ember.cluster import launcher
from ember.cluster.chaos import Cluster

ROOT = Path(__file__).resolve().parents[1]
# Every session cluster's services say NOT_SERVING this long before they refuse new calls when drained
# (EMBER_DRAIN_NOTICE_S; the shipped 1 s is two router health polls): tests/test_drain.py observes the
# notice through fresh calls, and on a loaded host 1 s leaves too little room to see it.
DRAIN_NOTICE_S = 2.0


def _exact(run_dir: Path, model: str) -> dict:
    from tests.cluster_fixture import write_config
    return write_config(run_dir / "cluster.yaml")


def _shipped(name: str) -> Callable[[Path, str], dict]:
    def write(run_dir: Path, model: str) -> dict:
        import yaml

        from ember.cluster.ports import on_free_ports
        router = on_free_ports(ROOT / "configs" / name, run_dir / "cluster.yaml", model)["router"]
        # The suite's tests of the shipped cluster look at its disaggregated path (prefill spans, KV
        # moved between the sites, a prefill worker killed): its shared-host placement (auto) would
        # colocate most of their requests. That choice has tests of its own (test_ttft_first,
        # test_default_cluster's routers forced to each placement).
        data = yaml.safe_load((run_dir / "cluster.yaml").read_text())
        data.setdefault("placement", {})["shared_host"] = "disaggregated"
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        return {"router": router["listen"], "router_http": router.get("http")}
    return write


CONFIGS: dict[str, Callable[[Path, str], dict]] = {
    "exact": _exact, "default": _shipped("local.yaml"), "ha": _shipped("local-ha.yaml")}
FIXTURES = {f"{kind}_cluster": kind for kind in CONFIGS}  # conftest's fixture names


@dataclass
class Running:
    """A session cluster: its chaos handle (kill, restart, stats, reset), its config file, and its
    addresses (router, router_http; the exact one's also prefill, decode, kv_central, ...: write_config's)."""
    kind: str
    cluster: Cluster
    config: Path
    addr: dict = field(default_factory=dict)
    resets: int = 0

    @property
    def run_dir(self) -> Path:
        return self.cluster.run_dir

    def as_dict(self) -> dict:
        """Its addresses, plus `config` (the YAML's path) and `run_dir`."""
        return self.addr | {"config": str(self.config), "run_dir": self.run_dir}


class SessionClusters:
    def __init__(self, root: Path, model: str):
        self.root, self.model = root, model
        self.current: Running | None = None

    def get(self, kind: str) -> Running:
        """The `kind` cluster in its start state: started now, or reset (and any service a module
        before left down started again)."""
        if self.current is not None and self.current.kind == kind:
            self.current.cluster.reset()
            self.current.resets += 1
            return self.current
        self.close()
        run_dir = self.root / kind
        run_dir.mkdir(parents=True, exist_ok=True)
        addr = CONFIGS[kind](run_dir, self.model)
        launcher.up(run_dir / "cluster.yaml", run_dir, timeout_s=300, env={"EMBER_DRAIN_NOTICE_S": str(DRAIN_NOTICE_S)})
        self.current = Running(kind, Cluster(run_dir), run_dir / "cluster.yaml", addr)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            launcher.down(self.current.run_dir)
            self.current = None
