"""Compose and Kubernetes run the block directory's Redis from deploy/cluster.yaml: TLS only, client
certificates of the cluster CA, the ACL users `ember certs` writes. The very redis-server command
both files give is run here (paths mapped onto `ember certs`' output), and each service logs in with
the user and password file its own settings name; Prometheus scrapes with the operator certificate."""
from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
import time
from urllib.parse import urlsplit

import pytest
import redis.asyncio as redis
import yaml
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from ember.config.services import kvstore_settings, router_settings, services
from tests.cluster_fixture import free_port
from tests.test_deploy import ROOT, TLS_ROOT, compose_model, config, ember_certs, kustomized

REDIS_TLS = "/etc/redis/tls"  # where both files mount redis/ of `ember certs`' output


def redis_commands() -> tuple[list[str], list[str]]:
    compose = compose_model()["services"]["redis"]["command"]
    [k8s] = [d for d in kustomized() if d["kind"] == "Deployment" and d["metadata"]["name"] == "redis"]
    [container] = k8s["spec"]["template"]["spec"]["containers"]
    return compose, container["command"]


def test_compose_and_kubernetes_run_redis_tls_only_with_the_acl_file():
    compose, k8s = redis_commands()
    assert compose == k8s, "one Redis setup in both"
    flags = dict(zip(compose[1::2], compose[2::2]))
    url = urlsplit(config().directory.url)
    assert url.scheme == "rediss" and flags["--port"] == "0", "no plaintext port"
    assert flags["--tls-port"] == str(url.port) and flags["--tls-auth-clients"] == "yes"
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file", "--aclfile"):
        assert flags[flag].startswith(REDIS_TLS + "/"), flag


def run_redis(argv: list[str], out, port: int) -> subprocess.Popen:
    """The deployments' redis-server command, its folder mapped onto `ember certs`' OUT/redis."""
    argv = [a.replace(REDIS_TLS, str(out / "redis")) for a in argv]
    argv[argv.index("--tls-port") + 1] = str(port)
    proc = subprocess.Popen([shutil.which("redis-server"), *argv[1:], "--bind", "127.0.0.1", "--dir", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    ping = ["redis-cli", "--tls", "--cacert", str(out / "ca.crt"), "--cert", str(out / "redis/tls.crt"),
            "--key", str(out / "redis/tls.key"), "-p", str(port), "ping"]
    while subprocess.run(ping, capture_output=True, text=True, timeout=10).stdout.strip() != "NOAUTH Authentication " \
            "required.":  # a TLS session with the cluster CA, and the default user off
        assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not come up"
        time.sleep(0.05)
    return proc


def test_each_service_logs_in_to_the_deployed_redis_with_the_password_file_ember_certs_wrote(tmp_path):
    out = tmp_path / "certs"
    ember_certs(out)
    c = config()
    acl = (out / "redis" / "users.acl").read_text()
    assert acl.startswith("user default off") and "\nuser ember-router " in acl and "\nuser ember-kvstore " in acl
    port = free_port()
    proc = run_redis(redis_commands()[0], out, port)
    try:
        for svc in services(c):
            if svc.role not in ("router", "kvstore"):
                assert not (out / svc.name / "redis-password").exists(), svc.name
                continue
            settings = router_settings(c).redis if svc.role == "router" else kvstore_settings(c, svc.site).redis
            assert settings.user.password_file == f"{TLS_ROOT}/{svc.name}/redis-password"  # in its own mount
            password = (out / svc.name / "redis-password").read_text().strip()
            assert hashlib.sha256(password.encode()).hexdigest() in acl and password not in acl
            assert (out / svc.name / "redis-password").stat().st_mode & 0o077 == 0
            asyncio.run(logs_in(out / svc.name, port, settings.user.username, password, svc.role))
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def logs_in(folder, port: int, username: str, password: str, role: str) -> None:
    def client(**auth) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(folder / "ca.crt"),
                           ssl_certfile=str(folder / "tls.crt"), ssl_keyfile=str(folder / "tls.key"),
                           socket_timeout=5, **auth)
    ok = client(username=username, password=password)
    try:
        assert await ok.ping()
        own = ("SET", "ember:blk:central:x", "1", "PX", "1000") if role == "kvstore" else ("SMEMBERS", "ember:routers")
        await ok.execute_command(*own)
        with pytest.raises(NoPermissionError):
            await ok.execute_command("FLUSHALL")
    finally:
        await ok.aclose()
    for auth in ({}, {"username": username, "password": password[:-1]}):
        anonymous = client(**auth)
        with pytest.raises((AuthenticationError, ResponseError)):
            await anonymous.get("ember:blk:central:x")
        await anonymous.aclose()


def test_prometheus_scrapes_every_service_over_https_with_the_operator_certificate():
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    [job] = scrape["scrape_configs"]
    assert job["scheme"] == "https" and config().security.metrics.auth == "mtls"
    volumes = compose_model()["services"]["prometheus"]["volumes"]
    mount = next(v for v in volumes if v["target"] == "/etc/prometheus/tls")
    assert mount["volume"]["subpath"] == "operator" and mount["read_only"]
    assert job["tls_config"] == {"ca_file": f"{mount['target']}/ca.crt", "cert_file": f"{mount['target']}/tls.crt",
                                 "key_file": f"{mount['target']}/tls.key"}
