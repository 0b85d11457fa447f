"""The installed package runs anywhere: a non-editable `pip install` of a copy of the checkout
(its gRPC stubs not generated yet) into a fresh venv, then, in an empty directory, `ember up` with
no arguments fetches the default model into a fresh user cache, starts the cluster and prints the
gRPC address, the OpenAI HTTP address and the run directory; the official `openai` client chats
through that address; `ember down` stops every process.

The fresh venv gets its third-party dependencies from this test's own environment through a
.pth line (a full dependency install would download torch); Ember itself, its services and its
configs come only from the wheel built here."""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
LEFT_OUT = {".git", ".venv", "third_party", "models", "runs", "bench-out", "build", "dist", ".pytest_cache",
            ".hypothesis", "__pycache__"}


def run(argv, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{argv} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def port_free(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def test_installed_package_runs_the_default_cluster_from_an_empty_directory(tmp_path):
    import openai
    import yaml
    shipped = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    addresses = [shipped["router"]["listen"], shipped["router"]["http"]] + [
        s[k] for s in shipped["sites"] for k in ("prefill", "decode", "kvstore", "kvstore_data") if k in s]
    busy = [a for a in addresses if not port_free(a)]
    assert not busy, f"the shipped config's ports are in use (a cluster still up? `ember down`): {busy}"

    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=lambda d, names: [n for n in names if n in LEFT_OUT or n.endswith(
        ".egg-info") or Path(d, n) == ROOT / "ember" / "v1"])  # the stubs: the build must generate them
    assert not (source / "ember" / "v1").exists()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = venv / "bin" / "python"
    purelib = run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    (Path(purelib) / "deps-from-test-env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(source)], timeout=600,  # isolated build, as users do
        cwd=tmp_path)
    assert not (Path(purelib) / "services").exists(), "no generic top-level `services` package"

    empty = tmp_path / "empty"
    empty.mkdir()
    pip_cache = run([sys.executable, "-m", "pip", "cache", "dir"]).stdout.strip()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EMBER_", "PYTHON", "VIRTUAL_ENV"))}
    env |= {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path / "state"),
            "PIP_CACHE_DIR": pip_cache, "PATH": f"{venv / 'bin'}{os.pathsep}{env['PATH']}"}
    where = run([str(py), "-c", "import ember, ember.services.router, ember.v1.router_pb2 as r; "
                                "print(ember.__file__); print(r.__file__)"], cwd=empty, env=env).stdout
    assert all(line.startswith(purelib) for line in where.split()), where
    ember = str(venv / "bin" / "ember")
    up = subprocess.run([ember, "up"], cwd=empty, env=env, capture_output=True, text=True, timeout=900)
    run_dir = tmp_path / "state" / "ember" / "runs" / "local"
    try:
        assert up.returncode == 0, up.stdout + up.stderr[-4000:]
        grpc_address = re.search(r"gRPC \(ember\.v1\.Router\):\s+(\S+)", up.stdout).group(1)
        http = re.search(r"OpenAI HTTP API:\s+(http://\S+)", up.stdout).group(1)
        printed_run_dir = Path(re.search(r"run directory:\s+(\S+)", up.stdout).group(1))
        assert (grpc_address, http) == (shipped["router"]["listen"], f"http://{shipped['router']['http']}/v1")
        assert printed_run_dir == run_dir and (run_dir / "router.log").exists()
        model = tmp_path / "cache" / "ember" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert model.exists(), "the named default model was fetched into the fresh user cache"
        assert list(empty.iterdir()) == [], "nothing is written to the working directory"

        client = openai.OpenAI(base_url=http, api_key="unused", max_retries=0, timeout=300)
        [listed] = client.models.list().data
        out = client.chat.completions.create(model=listed.id, max_tokens=8,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert out.choices[0].message.content and out.usage.completion_tokens > 0
        pids = json.loads((run_dir / "pids.json").read_text())
        assert set(pids) == {"kvstore-central", "kvstore-edge", "prefill-central", "decode-edge", "router",
                             "engine-template"}
        import psutil
        every = set(pids.values()) | {c.pid for p in pids.values() for c in psutil.Process(p).children(recursive=True)}
        assert len(every) >= 8, "two engine cores (forked by the engine template) run beside the five services"
    finally:
        down = subprocess.run([ember, "down"], cwd=empty, env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0 and "stopped 6 processes" in down.stdout, down.stdout + down.stderr
    deadline = time.monotonic() + 30
    while any(alive(p) for p in every):
        assert time.monotonic() < deadline, "processes outlived `ember down`"
        time.sleep(0.2)
    assert all(port_free(a) for a in addresses)
