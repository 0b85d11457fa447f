"""docker-compose.yml, deploy/ (Kubernetes, via kustomize) and `ember up` start the same services
from the same file, deploy/cluster.yaml, and give each the same effective settings. Validated
statically (no Docker engine or cluster here): the real Compose binary parses the file and
Kubernetes schemas check every manifest, the generated ConfigMap included."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ember.cluster.launcher import service_commands
from ember.config.load import config_from_dict, load_config
from ember.config.services import service_settings, services
from ember.services.common import service_parser

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"
MOUNTED = "/etc/ember/cluster.yaml"
# Every non-Ember container, with its pinned image: nothing is skipped unexamined.
INFRA_IMAGES = {"redis": "redis:7.0", "otel-collector": "otel/opentelemetry-collector:0.114.0",
                "jaeger": "jaegertracing/all-in-one:1.63.0", "prometheus": "prom/prometheus:v2.55.1"}


@pytest.fixture(autouse=True)
def baked_model_cache(monkeypatch):
    """The image's cache folder (Dockerfile: EMBER_CACHE_DIR), where the named model lives in containers."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    [cache] = [w.split("=", 1)[1] for line in dockerfile.splitlines() if line.startswith("ENV")
               for w in line.split() if w.startswith("EMBER_CACHE_DIR=")]
    monkeypatch.setenv("EMBER_CACHE_DIR", cache)
    return cache


def config():
    return load_config(CLUSTER_YAML)


def settings_of(argv: list[str], config_file: Path) -> tuple[str, dict]:
    """(role, effective settings) of the service a command line starts: parsed by the service's own
    parser, with the config it names read from `config_file` (the file mounted there)."""
    if argv[:2] == ["ember", "serve"]:
        role, rest = argv[2], argv[3:]
    else:
        assert argv[1:3] == ["-m", argv[2]] and argv[2].startswith("ember.services."), argv
        role, rest = argv[2].removeprefix("ember.services."), argv[3:]
    args = service_parser(role).parse_args(rest)
    site = getattr(args, "site", None)
    return role, service_settings(load_config(config_file), role, site, getattr(args, "worker", 0)) | {"site": site}


def expected() -> dict[str, dict]:
    c = config()
    return {s.name: service_settings(c, s.role, s.site, s.worker) | {"site": s.site} for s in services(c)}


# -- Compose ----------------------------------------------------------------------------
def compose_model() -> dict:
    import compose
    binary = Path(compose.__file__).parent / "docker-compose"
    args = [str(binary), "-f", str(ROOT / "docker-compose.yml"), "config"]
    check = subprocess.run(args + ["--quiet", "--no-env-resolution"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    out = subprocess.run(args + ["--format", "json", "--no-env-resolution"], capture_output=True, text=True,
                         timeout=60, check=True)
    return json.loads(out.stdout)


def test_compose_runs_every_service_of_the_cluster_yaml_with_its_settings():
    services_ = compose_model()["services"]
    want = expected()
    ember = {n: s for n, s in services_.items() if n not in INFRA_IMAGES}
    assert set(ember) == set(want), "Compose runs exactly the services deploy/cluster.yaml defines"
    for name, image in INFRA_IMAGES.items():
        assert services_[name]["image"] == image and "ember" not in " ".join(services_[name].get("command") or [])
    c = config()
    for name, svc in ember.items():
        assert svc["image"] == "ember:latest", name
        mounted = [v for v in svc["volumes"] if v["target"] == MOUNTED]
        assert mounted and Path(mounted[0]["source"]) == CLUSTER_YAML and mounted[0]["read_only"], name
        role, settings = settings_of(svc["command"], CLUSTER_YAML)
        assert settings == want[name], f"{name}: Compose gives it other settings than the YAML"
        address = settings["listen"]
        assert svc["healthcheck"]["test"][-1] == address and address.split(":")[0] == name
        assert address.rsplit(":", 1)[1] in svc["expose"] or name == "router"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://otel-collector:")
        assert not any("fetch-model" in " ".join(svc.get("command") or []) for svc in services_.values())
        if role == "router":
            published = {str(p["target"]) for p in svc["ports"]}
            assert {c.router.listen.rsplit(":", 1)[1], c.router.http.rsplit(":", 1)[1]} <= published
    # decode shares IPC and the arena socket's folder with its site's kvstore: the shared-memory path
    socket_dir = str(Path(c.kvstore.shm_socket).parent)
    for site in c.sites:
        if site.has("decode"):
            decode, store = ember[f"decode-{site.name}"], ember[f"kvstore-{site.name}"]
            assert decode["ipc"] == f"service:kvstore-{site.name}" and store["ipc"] == "shareable"
            shared = {v["source"] for v in decode["volumes"] if v["target"] == socket_dir}
            assert shared and shared == {v["source"] for v in store["volumes"] if v["target"] == socket_dir}
    for name, svc in services_.items():
        assert set(svc.get("depends_on", {})) <= set(services_), name
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in scrape["scrape_configs"] for c_ in job["static_configs"]
               for t in c_["targets"]}
    assert targets == set(want)


# -- Kubernetes -------------------------------------------------------------------------
def kustomized() -> list[dict]:
    """What `kubectl apply -k deploy/` applies: the listed resources in the namespace, and the
    ConfigMap generated from deploy/cluster.yaml."""
    k = yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text())
    listed = sorted(k["resources"])
    assert listed == sorted(f"k8s/{p.name}" for p in (ROOT / "deploy" / "k8s").glob("*.yaml")), \
        "every manifest in deploy/k8s is applied"
    docs = [d for r in listed for d in yaml.safe_load_all((ROOT / "deploy" / r).read_text()) if d]
    for doc in docs:
        if doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = k["namespace"]
    [gen] = k["configMapGenerator"]
    data = {Path(f).name: (ROOT / "deploy" / f).read_text() for f in gen["files"]}
    docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": gen["name"], "namespace": k["namespace"]}, "data": data})
    return docs


def test_kubernetes_manifests_are_schema_valid():
    docs = kustomized()
    for doc in docs:
        kubernetes_validate.validate(doc, "1.32", strict=True)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in [*expected(), "redis"]:
        assert ("Deployment", name) in kinds and ("Service", name) in kinds, name


def test_kubernetes_runs_every_service_of_the_same_yaml_with_its_settings():
    docs = kustomized()
    [configmap] = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["data"]["cluster.yaml"] == CLUSTER_YAML.read_text(), "the ConfigMap is the file itself"
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    want = expected()
    assert set(deployments) - {"redis"} == set(want)
    for svc in (d for d in docs if d["kind"] == "Service"):
        pods = [dep for dep in deployments.values()
                if svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()]
        assert pods, f"Service {svc['metadata']['name']} selects no pod template"
        container_ports = {p["containerPort"] for c in pods[0]["spec"]["template"]["spec"]["containers"]
                           for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= container_ports
    for name, dep in deployments.items():
        spec = dep["spec"]["template"]["spec"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        if name == "redis":
            continue
        [container] = spec["containers"]
        assert container["image"] == "ember:latest"
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(Path(MOUNTED).parent))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == configmap["metadata"]["name"]
        role, settings = settings_of(container["command"], CLUSTER_YAML)
        assert settings == want[name], f"{name}: Kubernetes gives it other settings than the YAML"
        assert {"name": "EMBER_BIND_HOST", "value": "0.0.0.0"} in container["env"]
        port = int(settings["listen"].rsplit(":", 1)[1])
        assert container["readinessProbe"]["grpc"]["port"] == port and settings["listen"].split(":")[0] == name
        assert "initContainers" not in spec, f"{name}: the model is baked into the image, no pod fetches it"
        assert not any("emptyDir" in v for v in spec["volumes"])


# -- the three agree ----------------------------------------------------------------------
def test_ember_up_compose_and_kubernetes_give_each_service_the_same_settings(tmp_path):
    compose = {n: settings_of(s["command"], CLUSTER_YAML)[1] for n, s in compose_model()["services"].items()
               if n not in INFRA_IMAGES}
    k8s = {d["metadata"]["name"]: settings_of(d["spec"]["template"]["spec"]["containers"][0]["command"],
                                              CLUSTER_YAML)[1]
           for d in kustomized() if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"}
    launched = {n: settings_of(argv, CLUSTER_YAML)[1]
                for n, (argv, _) in service_commands(config(), CLUSTER_YAML, tmp_path).items()}
    assert compose == k8s == launched == expected()
    # and each value is the YAML's own: the kvstore's capacity, the decode engine's pool
    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    assert compose["kvstore-edge"]["capacity_mb"] == raw["kvstore"]["capacity_mb"]
    assert compose["kvstore-edge"]["directory"] == raw["directory"]["url"]
    assert compose["decode-edge"]["engine"]["kv_cache_mb"] == raw["engine"]["kv_cache_mb"]
    assert compose["router"]["http"] == raw["router"]["http"]


def test_a_changed_setting_reaches_only_the_services_that_read_it(tmp_path):
    """The comparison above can fail: one edited key changes the settings of exactly its services."""
    raw = yaml.safe_load(CLUSTER_YAML.read_text())
    raw["kvstore"]["capacity_mb"] = 77
    raw["engine"]["decode"] = {"max_num_seqs": 5}
    edited = config_from_dict(raw, CLUSTER_YAML.parent)
    before, after = expected(), {s.name: service_settings(edited, s.role, s.site, s.worker) | {"site": s.site}
                                 for s in services(edited)}
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"kvstore-central", "kvstore-edge", "decode-edge"}
    assert after["decode-edge"]["engine"]["max_num_seqs"] == 5 and after["prefill-central"]["engine"][
        "max_num_seqs"] == before["prefill-central"]["engine"]["max_num_seqs"]


def test_the_image_bakes_the_default_model_the_container_config_names(baked_model_cache):
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ember fetch-model" in dockerfile and "pip install" in dockerfile
    assert str(config().model_path()).startswith(baked_model_cache + "/models/")
