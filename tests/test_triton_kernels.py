"""The Triton paged decode kernel equals the torch path: on a GPU when there is one, and
always under Triton's CPU interpreter (its CPU twin)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_check(device: str, interpret: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # read when kernels are defined: set before import
    return subprocess.run([sys.executable, str(ROOT / "tests" / "triton_check.py"), device],
                          capture_output=True, text=True, timeout=300, env=env)


def test_paged_decode_kernel_under_the_triton_interpreter():
    proc = run_check("cpu", interpret=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the interpreter twin runs on CPU")
def test_paged_decode_kernel_on_gpu():
    proc = run_check("cuda", interpret=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
