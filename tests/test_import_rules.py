"""Bookkeeping is torch-free; the core package never imports the services."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TORCH_FREE = ["ember.kv.block_hash", "ember.engine.block_manager", "ember.engine.scheduler",
              "ember.engine.sampling_params", "ember.engine.sequence", "ember.engine.detokenizer"]


def test_bookkeeping_modules_do_not_import_torch():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE) + \
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ember_never_imports_services():
    root = Path(__file__).resolve().parents[1] / "ember"
    offenders = [str(p) for p in root.rglob("*.py")
                 if any(line.lstrip().startswith(("import services", "from services"))
                        for line in p.read_text().splitlines())]
    assert offenders == []
