"""docker-compose.yml and deploy/k8s/, validated statically (no Docker engine or cluster here):
the real Compose binary parses the file, Kubernetes schemas check every manifest, and every
command, port and address agrees with the cluster config it mounts."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from ember.placement.config import ClusterConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SERVICES = {"router", "prefill", "decode", "kvstore"}


def compose_model() -> dict:
    import compose
    binary = Path(compose.__file__).parent / "docker-compose"
    args = [str(binary), "-f", str(ROOT / "docker-compose.yml"), "config"]
    check = subprocess.run(args + ["--quiet", "--no-env-resolution"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    out = subprocess.run(args + ["--format", "json", "--no-env-resolution"], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def runs_real_entry_point(command: list[str]) -> bool:
    if command[:2] == ["python", "-m"]:
        module = command[2]
        return (ROOT / module.replace(".", "/") / "__main__.py").exists() or \
            (ROOT / (module.replace(".", "/") + ".py")).exists()
    return command[0] == "ember"


def test_compose_file_is_valid_and_agrees_with_its_config():
    model = compose_model()
    services = model["services"]
    assert {"router", "prefill", "decode", "kvstore-central", "kvstore-edge", "redis", "otel-collector", "jaeger",
            "prometheus", "model"} <= set(services)
    config = load_config(ROOT / "configs" / "compose.yaml")
    for name, svc in services.items():
        command = svc.get("command") or []
        if svc.get("image") != "ember:latest":
            continue
        assert runs_real_entry_point(command), f"{name}: {command} is not an entry point in this repository"
        if name == "model":
            continue
        assert svc.get("healthcheck"), f"{name} has no health check"
        assert any(v["target"] == "/models" for v in svc.get("volumes", [])), f"{name} lacks the model volume"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
        mounted = [v for v in svc.get("volumes", []) if v["target"] == "/etc/ember/cluster.yaml"]
        assert mounted and Path(mounted[0]["source"]).name == "compose.yaml"
        health_target = svc["healthcheck"]["test"][-1]
        if name.startswith("kvstore-"):
            site = config.site(flag(command, "--site"))
            assert flag(command, "--listen") == site.kvstore == health_target
            assert flag(command, "--data-listen") == site.kvstore_data
            assert flag(command, "--directory") == config.directory
            exposed = set(svc.get("expose", []))
            assert {site.kvstore.rsplit(":", 1)[1], site.kvstore_data.rsplit(":", 1)[1]} <= exposed
        elif name in ("prefill", "decode"):
            assert flag(command, "--config") == "/etc/ember/cluster.yaml"
            site = config.site(flag(command, "--site"))
            address = getattr(site, name)
            assert address.split(":")[0] == name, f"{name}: the config says {address}"
            assert address == health_target and address.rsplit(":", 1)[1] in svc.get("expose", [])
        elif name == "router":
            assert config.router == health_target and config.router.split(":")[0] == "router"
            published = {str(p["target"]) for p in svc.get("ports", [])}
            assert {config.router.rsplit(":", 1)[1], config.router_http.rsplit(":", 1)[1]} <= published
    # every depends_on target exists and Prometheus scrapes every Ember service
    for name, svc in services.items():
        assert set(svc.get("depends_on", {})) <= set(services), name
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    assert targets == {"router", "prefill", "decode", "kvstore-central", "kvstore-edge"}


def k8s_docs() -> list[dict]:
    return [d for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def test_kubernetes_manifests_are_schema_valid():
    docs = k8s_docs()
    for doc in docs:
        kubernetes_validate.validate(doc, "1.32", strict=True)
    kinds = [(d["kind"], d["metadata"]["name"]) for d in docs]
    for name in ("router", "prefill-central", "decode-edge", "kvstore-central", "kvstore-edge", "redis"):
        assert ("Deployment", name) in kinds and ("Service", name) in kinds, name


def test_kubernetes_selectors_probes_commands_and_config_agree():
    docs = k8s_docs()
    [configmap] = [d for d in docs if d["kind"] == "ConfigMap"]
    config = ClusterConfig.model_validate(yaml.safe_load(configmap["data"]["cluster.yaml"]))
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for svc in (d for d in docs if d["kind"] == "Service"):
        pods = [dep for dep in deployments.values()
                if svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod template"
        container_ports = {p["containerPort"] for c in pods[0]["spec"]["template"]["spec"]["containers"]
                           for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    for name, dep in deployments.items():
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        if name == "redis":
            continue
        [container] = dep["spec"]["template"]["spec"]["containers"]
        command = container["command"]
        assert runs_real_entry_point(command), command
        assert {"name": "EMBER_BIND_HOST", "value": "0.0.0.0"} in container["env"]
        grpc_port = container["readinessProbe"]["grpc"]["port"]
        if name.startswith("kvstore-"):
            site = config.site(flag(command, "--site"))
            assert flag(command, "--listen") == site.kvstore and site.kvstore.split(":")[0] == name
            assert int(site.kvstore.rsplit(":", 1)[1]) == grpc_port
        elif name == "router":
            assert config.router.split(":")[0] == name and int(config.router.rsplit(":", 1)[1]) == grpc_port
        else:
            role = name.split("-")[0]
            address = getattr(config.site(flag(command, "--site")), role)
            assert address.split(":")[0] == name and int(address.rsplit(":", 1)[1]) == grpc_port
            assert dep["spec"]["template"]["spec"]["initContainers"][0]["command"][:2] == ["ember", "fetch-model"]


def test_compose_and_kubernetes_configs_describe_the_same_cluster():
    compose_cfg = load_config(ROOT / "configs" / "compose.yaml")
    [configmap] = [d for d in k8s_docs() if d["kind"] == "ConfigMap"]
    k8s_cfg = ClusterConfig.model_validate(yaml.safe_load(configmap["data"]["cluster.yaml"]))
    assert [s.name for s in compose_cfg.sites] == [s.name for s in k8s_cfg.sites]
    assert (compose_cfg.prefill_site, compose_cfg.decode_site) == (k8s_cfg.prefill_site, k8s_cfg.decode_site)
    assert os.path.basename(compose_cfg.model) == os.path.basename(k8s_cfg.model)
