"""docker-compose.yml, deploy/ (Kubernetes, via kustomize) and `ember up` start the same services
from the same file, deploy/cluster.yaml, and give each the same effective settings. Validated
statically (no Docker engine or cluster here): the real Compose binary parses the file and
Kubernetes schemas check every manifest, the generated ConfigMap included."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ember.cluster.launcher import TEMPLATE, service_commands
from ember.config.load import config_from_dict, load_config
from ember.config.services import security_settings, service_settings, services
from ember.services.common import service_parser

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "deploy" / "cluster.yaml"
MOUNTED = "/etc/ember/cluster.yaml"
# Every non-Ember container, with its pinned image: nothing is skipped unexamined.
INFRA_IMAGES = {"redis": "redis:7.0", "otel-collector": "otel/opentelemetry-collector:0.114.0",
                "jaeger": "jaegertracing/all-in-one:1.63.0", "prometheus": "prom/prometheus:v2.55.1",
                "grafana": "grafana/grafana:11.3.1"}
ONE_SHOT = {"certs"}  # Compose's job that writes every service's certificate folder before they start
TLS_ROOT = "/etc/ember/tls"  # each service mounts only its own folder, TLS_ROOT/<name>


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
    ember = {n: s for n, s in services_.items() if n not in INFRA_IMAGES and n not in ONE_SHOT}
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
    roles = {s.name: s.role for s in services(config())}  # each target labelled with its role (the dashboard)
    for c_ in (c_ for job in scrape["scrape_configs"] for c_ in job["static_configs"]):
        assert all(c_["labels"]["role"] == roles[t.split(":")[0]] for t in c_["targets"]), c_


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


def healthcheck_argv(name: str, address: str) -> list[str]:
    """How an internal service's health is checked in a container: mTLS with its own certificate folder."""
    return ["python", "-m", "ember.rpc.healthcheck", "--tls-dir", f"{TLS_ROOT}/{name}", address]


def probe_port(probe: dict, name: str) -> int:
    """The port a probe checks: the router's native grpc probe (its public port is plaintext), or an
    internal service's exec probe running the healthcheck with its own certificate folder."""
    if name == "router":
        return probe["grpc"]["port"]
    assert "grpc" not in probe, f"{name}: a native grpc probe cannot present a client certificate"
    argv = probe["exec"]["command"]
    assert argv == healthcheck_argv(name, argv[-1]) and argv[-1].startswith("127.0.0.1:"), (name, argv)
    return int(argv[-1].rsplit(":", 1)[1])


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
        assert probe_port(container["readinessProbe"], name) == port and settings["listen"].split(":")[0] == name
        assert "initContainers" not in spec, f"{name}: the model is baked into the image, no pod fetches it"
        assert not any("emptyDir" in v for v in spec["volumes"])


# -- the three agree ----------------------------------------------------------------------
def test_ember_up_compose_and_kubernetes_give_each_service_the_same_settings(tmp_path):
    compose = {n: settings_of(s["command"], CLUSTER_YAML)[1] for n, s in compose_model()["services"].items()
               if n not in INFRA_IMAGES and n not in ONE_SHOT}
    k8s = {d["metadata"]["name"]: settings_of(d["spec"]["template"]["spec"]["containers"][0]["command"],
                                              CLUSTER_YAML)[1]
           for d in kustomized() if d["kind"] == "Deployment" and d["metadata"]["name"] != "redis"}
    launched = {n: settings_of(argv, CLUSTER_YAML)[1]
                for n, (argv, _) in service_commands(config(), CLUSTER_YAML, tmp_path).items()
                if n != TEMPLATE}  # (the engine template: a local cluster's, ember.serving.template)
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


# -- security: mTLS certificates, one folder per service ------------------------------------
def test_the_container_config_uses_mounted_certificates_one_folder_per_service():
    c = config()
    assert c.security.tls == "files"
    for svc in services(c):
        assert security_settings(c, svc.name, env={}).tls_dir == f"{TLS_ROOT}/{svc.name}"


def tls_mounts(volumes: list[dict], certs_volume: str) -> list[dict]:
    return [v for v in volumes if v.get("source") == certs_volume or v["target"].startswith(TLS_ROOT)]


def test_compose_certs_job_runs_first_and_each_service_mounts_only_its_own_folder():
    model = compose_model()
    services_ = model["services"]
    job = services_["certs"]
    assert job["image"] == "ember:latest" and job.get("restart") == "no"
    assert job["command"][:2] == ["ember", "certs"]
    args = certs_job_args(job)
    assert args.config == MOUNTED and not args.force
    assert dict(args.chown) == {"redis": 999, "operator": 65534}  # the users of the redis and prometheus images
    args = {"--out": args.out}
    [out] = [v for v in job["volumes"] if v["target"] == args["--out"]]
    assert out["type"] == "volume" and out["source"] in model["volumes"] and not out.get("read_only")
    certs_volume = out["source"]
    ember = {n: s for n, s in services_.items() if n not in INFRA_IMAGES and n not in ONE_SHOT}
    assert set(ember) == set(expected())
    for name, svc in ember.items():
        assert svc["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
        [mount] = tls_mounts(svc["volumes"], certs_volume)  # exactly one: its own folder, nobody else's
        assert mount == {"type": "volume", "source": certs_volume, "target": f"{TLS_ROOT}/{name}",
                         "read_only": True, "volume": {"subpath": name}}, name
        test = svc["healthcheck"]["test"]
        if name == "router":  # its public port: plaintext (API keys), no certificate needed
            assert test[1:] == ["python", "-m", "ember.rpc.healthcheck", "--plaintext", config().router.listen]
        else:
            assert test[1:] == healthcheck_argv(name, expected()[name]["listen"]), name
    for name, svc in services_.items():  # the volume root (ca.key) is the job's alone
        if name not in ember and name != "certs":  # redis its own folder, Prometheus the operator's
            mounts = [v for v in svc.get("volumes") or [] if v.get("source") == certs_volume]
            want = {"redis": [("redis", "/etc/redis/tls")], "prometheus": [("operator", "/etc/prometheus/tls")]}
            assert [(v["volume"]["subpath"], v["target"]) for v in mounts] == want.get(name, []), name
            assert all(v["read_only"] for v in mounts), name


def certs_job_args(job: dict):
    """The Compose certs job's flags, parsed by `ember certs`' own parser."""
    from ember.cli import build_parser
    return build_parser().parse_args(job["command"][1:])


def test_kubernetes_pods_mount_only_their_own_certificate_secret():
    docs = kustomized()
    assert not [d for d in docs if d["kind"] == "Secret"], "no key material ships in the repo"
    assert "secretGenerator" not in yaml.safe_load((ROOT / "deploy" / "kustomization.yaml").read_text())
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    want = expected()
    for name in want:
        spec = deployments[name]["spec"]["template"]["spec"]
        secrets = [v for v in spec["volumes"] if "secret" in v]
        assert [v["secret"]["secretName"] for v in secrets] == [f"ember-tls-{name}"], name
        [container] = spec["containers"]
        mounts = [m for m in container["volumeMounts"] if m["name"] == secrets[0]["name"]
                  or m["mountPath"].startswith(TLS_ROOT)]
        assert mounts == [{"name": secrets[0]["name"], "mountPath": f"{TLS_ROOT}/{name}", "readOnly": True}], name
        port = int(want[name]["listen"].rsplit(":", 1)[1])
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe_port(container[probe], name) == port, (name, probe)
    for d in deployments.values():  # nobody else holds an Ember certificate: redis only its own folder
        if d["metadata"]["name"] not in want:
            secrets = [v["secret"]["secretName"] for v in d["spec"]["template"]["spec"].get("volumes", [])
                       if "secret" in v]
            assert secrets == (["ember-tls-redis"] if d["metadata"]["name"] == "redis" else []), d


def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(f.relative_to(folder)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(folder.rglob("*"))
            if f.is_file()}


def ember_certs(out: Path, *flags: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "certs", "--config", str(CLUSTER_YAML), "--out",
                           str(out), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_ember_certs_writes_a_folder_per_service_that_verifies_and_names_it(tmp_path):
    from cryptography import x509

    from ember.rpc.security import Credentials, Identity
    out = tmp_path / "certs"
    ember_certs(out)
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert (out / "ca.key").stat().st_mode & 0o077 == 0
    compose_names = set(compose_model()["services"])
    k8s_services = {d["metadata"]["name"] for d in kustomized() if d["kind"] == "Service"}
    c = config()
    macs = set()
    for svc in [*services(c), None]:
        name, identity = (svc.name, Identity(svc.role, svc.site)) if svc else ("operator", Identity("operator"))
        folder = out / name
        creds = Credentials.load(folder)
        assert creds.identity == identity, name
        assert creds.ca_pem == (out / "ca.crt").read_bytes()
        cert = x509.load_pem_x509_certificate(creds.cert_pem)
        cert.verify_directly_issued_by(ca)
        assert (folder / "tls.key").stat().st_mode & 0o077 == 0 and not (folder / "ca.key").exists()
        if svc is None:
            continue
        dns = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                  .get_values_for_type(x509.DNSName))
        assert name in compose_names and name in k8s_services and name in dns, (name, dns)
        hosts = {a.rsplit(":", 1)[0] for a in (svc.address, c.site(svc.site).kvstore_data if svc.role == "kvstore"
                                                else None) if a}
        assert hosts <= dns, (name, hosts, dns)  # the host names its peers dial (and verify)
        assert (creds.mac_key is not None) == (svc.role in ("prefill", "decode")), name
        if creds.mac_key is not None:
            macs.add(creds.mac_key)
    assert len(macs) == 1 and len(macs.pop()) >= 32, "one KV MAC secret, shared by the KV producers only"
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([*expected(), "operator", "redis"])

    before = _files(out)
    again = ember_certs(out)  # Compose's job reruns on every `up`: it must not rotate anything
    assert "left as is" in again.stdout and _files(out) == before
    ember_certs(out, "--force")
    assert (out / "ca.crt").read_bytes() != before["ca.crt"][0], "--force makes a new CA"
    assert Credentials.load(out / "router").ca_pem == (out / "ca.crt").read_bytes()


def test_healthcheck_with_its_own_folder_passes_an_mtls_port_and_plaintext_does_not(tmp_path):
    """What the container probes run: the service's own folder, dialing 127.0.0.1 (its SANs include it)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from ember.rpc import healthcheck
    from ember.rpc.security import Credentials
    ember_certs(tmp_path)
    creds = Credentials.load(tmp_path / "kvstore-central")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", creds.server_credentials())
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        assert healthcheck.main(["--tls-dir", str(tmp_path / "kvstore-central"), address]) == 0
        assert healthcheck.main(["--plaintext", address]) == 1
        assert healthcheck.main(["--tls-dir", str(tmp_path / "nowhere"), address]) == 1
    finally:
        server.stop(0)
