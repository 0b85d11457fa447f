"""The one cluster schema: a typo is an error that names it, every documented key is read by the
service that owns it, the kvstore honours its YAML, `ember config check` says where each value
came from, and values that follow from the model are derived, not configured."""
from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from ember.cluster.launcher import default_config, service_commands, wait_serving
from ember.cluster.ports import write_kvstore_config
from ember.config.derived import kv_bytes_per_token, model_facts
from ember.config.load import _model_in, config_from_dict, load_config
from ember.config.schema import ClusterConfig
from ember.config.section import record_reads
from ember.config.services import engine_settings, kvstore_settings, router_settings, security_settings, services
from ember.config.weights import weight_store_settings
from ember.engine.config import EngineSettings
from ember.placement.cli import main_for_tests
from ember.util.cpus import format_cpus, host_cpus

ROOT = Path(__file__).resolve().parents[1]


def local() -> dict:
    return yaml.safe_load(default_config().read_text())


def error_of(data: dict) -> str:
    with pytest.raises(ValueError) as e:
        config_from_dict(data, ROOT, "cluster.yaml")
    return str(e.value)


def test_a_typo_is_an_error_that_names_the_key_and_the_likely_one():
    data = local()
    data["engine"]["kv_cache_mbb"] = 64
    message = error_of(data)
    assert "engine.kv_cache_mbb" in message and "did you mean `kv_cache_mb`" in message
    data = local()
    data["sites"][1]["decod"] = "127.0.0.1:1"
    assert "sites.1.decod" in error_of(data) and "`decode`" in error_of(data)
    data = local()
    data["kvstore_capacity_mb"] = 64  # the flat layout's name
    assert "kvstore_capacity_mb (got 64): unknown key; it moved to `kvstore.capacity_mb`" in error_of(data)
    data = local()
    data["router"] = "127.0.0.1:50051"
    assert "router" in error_of(data) and "listen: 127.0.0.1:50051" in error_of(data)
    data = local()
    data["engine"]["decode"] = {"dtype": "float32"}  # KV bytes must match across roles
    assert "engine.decode.dtype" in error_of(data)


def test_one_rule_for_q4_and_its_dtype_wherever_it_is_set():
    data = local()
    data["engine"].update(weights="q4", dtype="float32")
    assert "needs dtype 'bfloat16'" in error_of(data)
    from ember.engine.config import EngineConfig
    with pytest.raises(ValueError, match="needs dtype 'bfloat16'"):
        EngineConfig(weights="q4", dtype="float32")


def test_per_role_engine_settings_override_only_their_role(model_path):
    data = local()
    data["model"] = str(model_path)
    data["engine"]["decode"] = {"max_num_seqs": 8, "threads": 1, "cpus": "0"}
    data["engine"]["threads"] = 2
    config = config_from_dict(data, ROOT)
    _, decode = engine_settings(config, "decode", "edge")
    _, prefill = engine_settings(config, "prefill", "central")
    assert (decode.max_num_seqs, decode.threads, decode.cpus) == (8, 1, "0")
    assert (prefill.max_num_seqs, prefill.threads) == (ClusterConfig.model_fields["engine"].default.max_num_seqs, 2)
    assert prefill.cpus != "auto"  # resolved: a set of this host's cores, or None (not pinned)


def test_paths_resolve_against_the_config_file_and_named_models_against_the_cache(tmp_path, model_path):
    (tmp_path / "sub").mkdir()
    data = local()
    data["model"] = "weights/m.gguf"
    (tmp_path / "sub" / "cluster.yaml").write_text(yaml.safe_dump(data))
    assert load_config(tmp_path / "sub" / "cluster.yaml").model_path() == tmp_path / "sub" / "weights" / "m.gguf"
    assert load_config(default_config()).model_path() == model_path  # the named default: the user cache


def test_kv_bytes_per_token_follow_the_model_and_dtype(model_path):
    data = local()
    data["model"] = str(model_path)
    q4 = config_from_dict(data, ROOT)
    data["engine"].update(weights="dense", dtype="float32")
    fp32 = config_from_dict(data, ROOT)
    layers, kv_heads, head_dim = 30, 3, 64  # SmolLM2-135M
    assert kv_bytes_per_token(q4) == 2 * layers * kv_heads * head_dim * 2  # bf16 KV
    assert kv_bytes_per_token(fp32) == 2 * layers * kv_heads * head_dim * 4
    assert model_facts(q4).kv_layout != model_facts(fp32).kv_layout
    data["placement"]["kv_bytes_per_token"] = 1000  # a simulation of another model may say
    assert kv_bytes_per_token(config_from_dict(data, ROOT)) == 1000


def test_config_check_prints_every_setting_with_its_source(tmp_path, capsys, model_path):
    data = local()
    data["model"] = str(model_path)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main_for_tests(["config", "check", str(path)]) == 0
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line and line[0] != "#"}
    line_of = {k: i + 1 for i, k in enumerate(path.read_text().splitlines())}
    cpus_line = next(i for k, i in line_of.items() if k.strip().startswith("cpus:"))
    assert out["engine.cpus"].split()[1] == "auto" and out["engine.cpus"].endswith(f"cluster.yaml:{cpus_line}")
    assert out["engine.block_size"].endswith("# default")
    assert out["router.site"].split()[1] == "edge" and "placement.decode_site" in out["router.site"]
    assert out["derived.kv_bytes_per_token"].split()[1] == "23040" and "bfloat16" in out["derived.kv_bytes_per_token"]
    assert out["kvstore.capacity_mb"].split()[1] == "1024"


def test_the_kvstore_process_honours_its_section_of_the_yaml(tmp_path):
    from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
    addr = write_kvstore_config(tmp_path / "kv.yaml", capacity_mb=77, codec="planes")
    log = tmp_path / "kv.log"
    proc = subprocess.Popen([sys.executable, "-m", "ember.services.kvstore", "--config", str(tmp_path / "kv.yaml"),
                             "--site", "solo"], stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_serving(addr["kvstore"], time.monotonic() + 60, proc, log)
        with grpc.insecure_channel(addr["kvstore"]) as ch:
            stats = kvstore_pb2_grpc.KVStoreStub(ch).Stats(kvstore_pb2.StatsRequest(), timeout=10)
        assert stats.capacity_bytes == 77 * 2**20 and stats.data_address == addr["kvstore_data"]
    finally:
        proc.kill()
        proc.wait(timeout=10)
    bad = subprocess.run([sys.executable, "-m", "ember.services.kvstore", "--config", str(tmp_path / "kv.yaml"),
                          "--site", "nowhere"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown site 'nowhere'" in bad.stderr


def full_config(model_path: Path) -> dict:
    """A config that sets every section: three sites, links, regions, profiles, Redis, overrides."""
    def a(port):
        return f"127.0.0.1:{port}"
    profile = {"prefill_tokens_per_s": 2000, "prefill_context_tokens": 3000, "decode_tokens_per_s": 14,
               "decode_batch_tokens_per_s": 190, "max_batch": 8, "pool": "decode-heavy"}
    return {
        "model": str(model_path),
        "router": {"listen": a(41000), "http": a(41001), "site": "west", "slo": {"ttft_s": 2.0, "tpot_s": 0.5},
                   "reflection": True, "tls": {"cert": "router.crt", "key": "router.key", "ca": "router-ca.crt"}},
        "placement": {"policy": "ember", "prefill_site": "central", "decode_site": "west", "session_affinity": True,
                      "codec_saving": 0.2, "decode_heavy_ratio": 2.0, "pool_slack_ms": 5,
                      "default_output_tokens": 100, "kv_bytes_per_token": 30000, "emulate_links": True},
        "sites": [{"name": "central", "tier": "central", "hardware": "big", "roles": ["prefill",
                   "kvstore"], "prefill": a(41010), "kvstore": a(41011), "kvstore_data": a(41012)},
                  {"name": "west", "capacity": 4, "prefill": a(41020), "decode": a(41021), "kvstore": a(41022),
                   "kvstore_data": a(41023)},
                  {"name": "east", "decode": a(41030), "kvstore": a(41031), "kvstore_data": a(41032)}],
        "links": [{"a": "central", "b": "west", "rtt_ms": 40, "bandwidth_gbps": 1},
                  {"a": "central", "b": "east", "rtt_ms": 40, "bandwidth_gbps": 1}],
        "regions": [{"name": "users-west", "reach": [{"site": "west", "rtt_ms": 5}, {"site": "east", "rtt_ms": 30}]}],
        "hardware": {"big": profile},
        "engine": {"dtype": "float32", "weights": "dense", "block_size": 16, "memory_utilization": 0.5,
                   "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 2048, "threads": 1,
                   "cpus": "auto",
                   "prefill": {"kv_cache_mb": 64, "memory_utilization": 0.6, "max_num_seqs": 4,
                               "max_num_batched_tokens": 256, "threads": 1},
                   # (every core this process may use: the engine built in-process pins its caller)
                   "decode": {"max_num_seqs": 8, "cpus": format_cpus(host_cpus())}},
        "kvstore": {"capacity_mb": 64, "codec": "planes", "shared_memory": True, "shm_socket": "@ember-test",
                    "chunks_dir": "/tmp/ember-test-chunks", "chunks_capacity_mb": 512, "chunks_codec": "raw"},
        "directory": {"url": "rediss://127.0.0.1:1/0", "ttl_s": 30, "tls_ca": "redis-ca.crt", "client_cert": False,
                      "users": {"router": {"username": "r", "password_file": "certs/{name}/redis-password"},
                                "kvstore": {"username": "k", "password_env": "EMBER_TEST_REDIS_PASSWORD"}}},
        "security": {"tls": "files", "tls_dir": "certs/{name}", "metrics": {"auth": "token",
                                                                             "token_file": "metrics.token"}},
    }


def schema_fields() -> set[tuple[str, str]]:
    """(section, key) of every key the schema documents."""
    seen, todo, out = set(), [ClusterConfig], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for name, field in cls.model_fields.items():
            out.add((cls.__name__, name))
            inner = _model_in(field.annotation)
            if inner is not None:
                todo.append(inner)
    return out


@pytest.mark.slow
def test_every_documented_key_is_read_by_a_service(tmp_path, model_path):
    """Start-up of every service of a config that sets every key, placement of requests under each
    policy, and each engine's start: a key none of them reads fails this test."""
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.placement.policy import Load, Placer, Request
    from ember.placement.simulate import Simulator
    from ember.placement.trace import agentic
    data = full_config(model_path)
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    config = load_config(path)
    engines = {}
    with record_reads() as reads:
        router_settings(config)
        model_facts(config)
        service_commands(config, path, tmp_path)  # ember up: which processes, emulated links, addresses
        for svc in services(config):
            security_settings(config, svc.name, env={})
            if svc.role == "kvstore":
                kvstore_settings(config, svc.site)
                weight_store_settings(config, svc.site)  # (its model chunks: services/kvstore/__main__.py)
            elif svc.role in ("prefill", "decode"):
                engines[svc.name] = engine_settings(config, svc.role, svc.site)[1]
        for policy in ("ember", "central", "edge", "fixed"):
            placed = config.model_copy(update={"placement": config.placement.model_copy(update={"policy": policy})})
            placer = Placer(placed)
            for output in (0, 10, 10_000):  # the default, a prefill-heavy and a decode-heavy shape
                placer.place(Request(3000, output, "users-west", {"central": 20}, f"s{output}"), Load())
                placer.place(Request(3000, output, None, {}, ""), Load())
        # unstreamed (kvstore.stream_prefill off), remote KV is pulled, and the codec prices the links
        pulled = config.model_copy(update={"kvstore": config.kvstore.model_copy(update={"stream_prefill": False})})
        Placer(pulled).place(Request(3000, 10, "users-west", {}, "p"), Load())
        trace = agentic(["users-west"], [1.0], sessions_per_s=1.0, duration_s=20, seed=1)
        Simulator(config, "ember").run(trace)  # `ember simulate`: the profiles' decode speeds
    unread = sorted(schema_fields() - reads)
    assert unread == [], f"documented keys no service reads: {unread}"
    used = set()  # and each engine setting is used by the engine itself (one engine sizes its pool in MiB,
    for name in ("prefill-central", "decode-east"):  # the other by the memory fraction)
        with record_reads() as engine_reads:
            LLMEngine(engines[name]).generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2))
        used |= {key for cls, key in engine_reads if cls == "EngineConfig"}
    assert set(EngineSettings.model_fields) - used == set(), "engine settings no engine reads"


def test_the_unread_key_check_can_fail():
    config = ClusterConfig.model_validate(copy.deepcopy(local()))
    with record_reads() as reads:
        config.kvstore.capacity_mb  # noqa: B018
    assert reads == {("ClusterConfig", "kvstore"), ("KVStoreSection", "capacity_mb")}


def test_the_package_list_covers_every_folder():
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    dirs = {"ember"} | {"ember." + ".".join(p.relative_to(ROOT / "ember").parts) for p in (ROOT / "ember").rglob("*")
                        if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))}
    dirs |= {"ember.services." + ".".join(p.relative_to(ROOT / "services").parts)
             for p in (ROOT / "services").rglob("*") if p.is_dir() and any(p.glob("*.py"))}
    dirs |= {"ember.services", "ember.configs", "ember.v1"}
    assert listed == dirs
    assert project["package-dir"] == {"ember": "ember", "ember.services": "services", "ember.configs": "configs"}


def test_every_shipped_config_loads_and_only_an_explicit_one_is_plaintext():
    """Each file under configs/ validates; none runs plaintext (security.tls is auto unless a config
    says otherwise), and local-secure.yaml also demands an API key and serves its public ports over TLS."""
    shipped = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(shipped) >= 4
    for path in shipped:
        config = load_config(path)
        assert config.security.tls == "auto", path.name
    secure = load_config(ROOT / "configs" / "local-secure.yaml")
    assert secure.router.require_api_key and "tls: auto" in (ROOT / "configs" / "local-secure.yaml").read_text()
    assert secure.router.tls == "auto" and all(load_config(path).router.tls is None for path in shipped
                                                  if path.name != "local-secure.yaml")


def test_plaintext_and_mounted_certificates_are_said_out_loud(tmp_path):
    base = {"sites": [{"name": "solo", "kvstore": "127.0.0.1:1"}]}
    with pytest.raises(ValueError, match="tls_dir"):
        config_from_dict(base | {"security": {"tls": "files"}}, tmp_path)
    with pytest.raises(ValueError, match="no certificates are known"):
        security_settings(config_from_dict(base, tmp_path), "kvstore-solo", env={})
    assert security_settings(config_from_dict(base | {"security": {"tls": "plaintext"}}, tmp_path), "kvstore-solo",
                             env={}).tls_dir is None
    files = config_from_dict(base | {"security": {"tls": "files", "tls_dir": "/etc/ember/tls/{name}"}}, tmp_path)
    assert security_settings(files, "kvstore-solo", env={}).tls_dir == "/etc/ember/tls/kvstore-solo"
    assert security_settings(files, "kvstore-solo", env={"EMBER_TLS_DIR": "/run/x"}).tls_dir == "/run/x"
