"""A real Prometheus (Debian's `prometheus`, which .ci/run installs) scrapes the session's default
cluster over mTLS with the operator certificate, as deploy/prometheus.yml has Compose's do; a PromQL
p50 of the TTFT histogram agrees with the TTFTs a client measured for the same requests (within one
bucket); and the Grafana dashboard (deploy/grafana/ember.json) names only metrics the cluster's
services really export (their live /metrics, HELP/TYPE lines included: a labelled counter nobody
has incremented yet is exported too)."""
from __future__ import annotations

import bisect
import json
import re
import shutil
import statistics
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from ember.client import RouterClient
from ember.cluster.ports import free_port
from ember.rpc import metrics, metrics_http
from tests.cluster_fixture import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "ember.json"
REQUESTS = 8


def endpoints(run_dir: Path) -> dict[str, dict]:
    services = json.loads((run_dir / "services.json").read_text())
    return {name: info["metrics"] for name, info in services.items() if info.get("metrics")}


@pytest.fixture(scope="module")
def prometheus(default_cluster, tmp_path_factory):
    """Prometheus on a free port, scraping every service of the cluster each second."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (.ci/run installs Debian's package)"
    folder = tmp_path_factory.mktemp("prometheus")
    jobs = {}
    roles = {name: info["role"] for name, info in json.loads((default_cluster.run_dir / "services.json").read_text())
             .items()}
    for name, e in endpoints(default_cluster.run_dir).items():  # a `role` label per target, as deploy/prometheus.yml
        job = jobs.setdefault(e["scheme"], {"job_name": f"ember-{e['scheme']}", "scheme": e["scheme"],
                                            "static_configs": []})
        if e["scheme"] == "https":
            job["tls_config"] = {"ca_file": e["ca"], "cert_file": e["cert"], "key_file": e["key"]}
        job["static_configs"].append({"targets": [e["address"]], "labels": {"role": roles[name]}})
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": list(jobs.values())}))
    address = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
                             f"--web.listen-address={address}"], stdout=open(folder / "prometheus.log", "wb"),
                            stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {(folder / 'prometheus.log').read_text()[-2000:]}")
            try:
                targets = api(address, "targets")["activeTargets"]
            except OSError:
                return False
            return len(targets) == len(endpoints(default_cluster.run_dir)) and all(
                t["health"] == "up" for t in targets)
        wait_until(up, 60, "prometheus scraping every service")
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def api(address: str, path: str, **params) -> dict:
    url = f"http://{address}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def query(address: str, promql: str, at: float | None = None) -> list[dict]:
    return api(address, "query", query=promql, **({"time": f"{at:.3f}"} if at is not None else {}))["result"]


def test_promql_ttft_p50_agrees_with_the_clients(default_cluster, prometheus):
    count = "sum(ember:time_to_first_token_seconds_count)"

    def scraped_count() -> float | None:
        result = query(prometheus, count)
        return float(result[0]["value"][1]) if result else None
    wait_until(lambda: scraped_count() is not None, 30, "the router's TTFT histogram in prometheus")
    t0, before = time.time(), scraped_count()
    ttfts = []
    with RouterClient(default_cluster.cluster.router) as client:
        for i in range(REQUESTS):  # one after another, prompts nobody sent: real prefills
            start = time.perf_counter()
            first = None
            for msg in client.stream(text=f"[prom-{t0:.0f}-{i}] Name a colour of the sea.", max_tokens=4,
                                     ignore_eos=True, timeout=120):
                if msg.token_ids and first is None:
                    first = time.perf_counter() - start
            ttfts.append(first)
    wait_until(lambda: scraped_count() >= before + REQUESTS, 30, "prometheus scraping the requests' TTFTs")
    t1 = time.time()
    bucket = "sum by (le) (ember:time_to_first_token_seconds_bucket{})"  # (`@` goes on the selector)
    window = f"{bucket.format('')} - {bucket.format(f' @ {t0:.3f}')}"  # these requests' observations only
    [p50] = query(prometheus, f"histogram_quantile(0.5, {window})", at=t1)
    promql = float(p50["value"][1])
    client = statistics.median(ttfts)
    bounds = list(metrics.TTFT._upper_bounds)  # the histogram's buckets (le), +Inf last
    print(f"TTFT p50: PromQL {promql:.4f} s, clients {client:.4f} s ({ttfts})")
    assert abs(bisect.bisect_left(bounds, promql) - bisect.bisect_left(bounds, client)) <= 1, (promql, client)


def test_the_grafana_dashboard_names_only_exported_metrics(default_cluster, prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 12 and all(exprs)
    for panel in dashboard["panels"]:  # every panel reads the data source variable
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    exported: set[str] = set()
    for e in endpoints(default_cluster.run_dir).values():
        for line in metrics_http.fetch(e, 10).splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                exported |= {"counter": {name + "_total", name}, "histogram": {name + "_bucket", name + "_count",
                                                                               name + "_sum"}}.get(kind, {name})
    named = {m for e in exprs for m in re.findall(r"ember:[A-Za-z0-9_:]+", e)}
    assert named and not named - exported, sorted(named - exported)
    for e in exprs:  # and Prometheus parses every one of them
        query(prometheus, e.replace("$__rate_interval", "1m"))
    # the tokens/s panel counts the router's tokens alone (the engines count the same ones per step)
    [tokens] = [p for p in dashboard["panels"] if p["title"] == "Tokens per second"]
    assert all('role="router"' in t["expr"] for t in tokens["targets"])
    assert query(prometheus, 'count(ember:prompt_tokens_total{role="router"})')[0]["value"][1] == "1"
