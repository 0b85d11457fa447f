"""Bookkeeping is torch-free; the core package never imports the services."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TORCH_FREE = ["ember.kv.block_hash", "ember.kv.chunks", "ember.kv.transfer", "ember.kv.bulk",
              "ember.engine.block_manager", "ember.engine.scheduler", "ember.engine.sampling_params",
              "ember.engine.sequence", "ember.engine.detokenizer", "ember.model.tokenizer", "ember.model.files",
              "ember.cluster.config", "ember.services.kvstore.store", "ember.services.kvstore.service", "ember.services.router.service",
              "ember.kv.wire", "ember.kv.codec", "ember.kv.shm", "ember.kv.directory", "ember.services.kvstore.pull",
              "ember.services.kvstore.publisher", "ember.placement.config", "ember.placement.policy",
              "ember.placement.simulate", "ember.placement.trace", "ember.placement.cli", "ember.cluster.wan",
              "ember.rpc.site_kv", "ember.rpc.kv_connector", "ember.engine.outputs", "ember.serving.messages",
              # the service process of an engine-backed service: the model lives in its engine core
              "ember.serving.engine_client", "ember.services.prefill.service", "ember.services.decode.service"]
ROOT = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> list[str]:
    return [line.split()[1] for line in path.read_text().splitlines()
            if line.startswith(("import ", "from ")) and len(line.split()) > 1]


def test_bookkeeping_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + \
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ember_never_imports_services():
    offenders = [str(p) for p in (ROOT / "ember").rglob("*.py")
                 if any(line.lstrip().startswith(("import ember.services", "from ember.services"))
                        for line in p.read_text().splitlines())]
    assert offenders == []


def test_services_never_import_each_other():
    for service in ("router", "prefill", "decode", "kvstore"):
        for path in (ROOT / "services" / service).rglob("*.py"):
            others = [m for m in imports_of(path) if m.startswith("ember.services.")
                      and m.split(".")[2] not in (service, "common")]
            assert others == [], f"{path} imports {others}"


def test_core_never_touches_generated_stubs_or_grpc():
    for package in ("engine", "model", "kernels"):
        for path in (ROOT / "ember" / package).rglob("*.py"):
            bad = [m for m in imports_of(path) if m.startswith(("ember.v1", "grpc"))]
            assert bad == [], f"{path} imports {bad}"


def test_omp_wait_policy_passive_unless_opted_out():
    """Ember processes wait passively (co-located processes would collapse each other); a process
    alone on its cores can keep libgomp's spin with EMBER_OMP_PASSIVE=0."""
    import os
    code = "import os, ember; print(os.environ.get('OMP_WAIT_POLICY'))"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "EMBER_OMP_PASSIVE")}
    def policy(**extra) -> str:
        return subprocess.run([sys.executable, "-c", code], env=base | extra, capture_output=True, text=True,
                              check=True, timeout=60).stdout.strip()
    assert policy() == "PASSIVE"
    assert policy(EMBER_OMP_PASSIVE="0") == "None"
    assert policy(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
