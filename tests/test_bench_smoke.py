"""Every `ember bench` subcommand runs to completion at its smoke size (`--quick`), as a user runs it:
the real CLI in its own process, writing its JSON (targets included). What the figures say is
BENCHMARKS.md's business, from full runs; here a bench that no longer runs at all fails (`ember bench
kv` once went unnoticed for a whole issue, its pull refused since the security work)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ember.cli import BENCHES

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# run elsewhere, with more asserted about what they write
COVERED = {"agentic": "tests/test_agentic_bench.py", "tenants": "tests/test_tenant_fairness.py"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", sorted(set(BENCHES) - set(COVERED)))
def test_the_bench_runs_to_completion_at_its_smoke_size(what, tmp_path, model_path):
    out = tmp_path / f"{what}.json"
    proc = subprocess.run([sys.executable, "-m", "ember.cli", "bench", what, "--quick", "--model", str(model_path),
                           "--output", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=540)
    if what == "gpu":
        import torch
        if not torch.cuda.is_available():  # it says why and stops; scripts/gpu-check.sh runs it on a GPU
            assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stdout + proc.stderr, proc.stderr[-2000:]
            return
    missed = ""
    if proc.returncode != 0 and out.exists():  # chaos exits 1 on a missed (correctness) target: say which
        missed = json.dumps({k: v for k, v in json.loads(out.read_text()).get("targets", {}).items()
                             if not v.get("met")} | {"scenarios": json.loads(out.read_text()).get("scenarios")})
    assert proc.returncode == 0, (f"ember bench {what} --quick exited {proc.returncode}:\n{proc.stderr[-4000:]}\n"
                                  f"{missed[:6000]}")
    result = json.loads(out.read_text())
    assert isinstance(result.get("targets"), dict) and result["targets"], f"{what} wrote no targets"
