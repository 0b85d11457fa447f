"""The engine's GPU path (ember.engine.device): the Triton paged decode-attention kernel wired into
the engine, torch SDPA for prefill, blocks in and out of device memory. On CUDA when there is a GPU;
always on CPU under Triton's interpreter (TRITON_INTERPRET=1), its twin: the same kernel, the same
wiring, fp32, token for token against transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MAX_NEW = 6
def needs_gpu(test):
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the Triton-interpreter twin "
                                                                   "runs on CPU")
    return pytest.mark.gpu(skip(test))


def run_check(device: str, attention: str, dtype: str, interpret: bool) -> dict:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="2")
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # read when kernels are defined: set before import
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu_engine_check.py"), device, attention, dtype,
                           str(MAX_NEW)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_tokens(got: dict, hf_greedy) -> None:
    """Every answer is transformers' greedy tokens, whole (shorter only where transformers stops too)."""
    def same(tokens: list[int], ids: list[int], asked: int) -> None:
        want = hf_greedy(ids, MAX_NEW)[:asked]
        assert tokens == want[:len(tokens)] and (len(tokens) == asked or len(want) == len(tokens))
    for ids, tokens in zip(got["prompts"], got["batch"]):
        same(tokens, ids, MAX_NEW)
    assert got["reused_cached"] >= 16, "the second prompt should reuse the first one's block"
    same(got["reused"], got["longer"], max(2, MAX_NEW // 2))
    assert got["imported"] == 1 and got["continued_cached"] >= 16, "the imported block should be used"
    same(got["continued"], got["longer"], max(2, MAX_NEW // 2))


def test_engine_on_the_triton_kernel_under_the_interpreter(hf_greedy):
    got = run_check("cpu", "triton", "float32", interpret=True)
    assert "triton-paged-decode-attention" in got["kernels"]
    check_tokens(got, hf_greedy)


def test_triton_on_cpu_without_the_interpreter_is_refused():
    from ember.engine.device import attention_backend
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs under Triton's interpreter")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        attention_backend("triton", torch.device("cpu"), "float32")


def test_device_choices():
    from ember.engine.device import attention_backend, collective_backend, rank_device, resolve_device
    cpu = torch.device("cpu")
    assert resolve_device("cpu") == cpu
    assert attention_backend("auto", cpu, "float32") == "torch"
    assert attention_backend("auto", cpu, "bfloat16") == "cpp"
    assert attention_backend("auto", torch.device("cuda"), "bfloat16") == "triton"
    assert collective_backend(cpu, 2) == "gloo" and rank_device(cpu, 1, 2) == cpu
    with pytest.raises(ValueError, match="cpp"):
        attention_backend("cpp", cpu, "float32")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
        assert resolve_device("auto") == cpu


@needs_gpu
def test_engine_on_cuda_fp32_matches_transformers(hf_greedy):
    got = run_check("cuda", "auto", "float32", interpret=False)
    assert got["device"].startswith("cuda") and "triton-paged-decode-attention" in got["kernels"]
    check_tokens(got, hf_greedy)


@needs_gpu
def test_engine_on_cuda_bf16_serves():
    """bf16 on the GPU is not the exact path: it must serve whole answers, and mostly agree."""
    got = run_check("cuda", "auto", "bfloat16", interpret=False)
    assert all(len(t) == MAX_NEW for t in got["batch"])
    assert got["imported"] == 1 and got["continued_cached"] >= 16


def test_the_device_follows_the_weights_never_the_other_way():
    """The default Q4_1 GGUF resolves to q4 weights everywhere (the router hashes blocks with that
    resolution), so `device: auto` keeps it on CPU even with a GPU, and `device: cuda` is refused
    with the fix; dense weights may go to the GPU."""
    from ember.engine.config import EngineConfig
    assert EngineConfig().device == "cpu" and EngineConfig().weights == "q4"
    with pytest.raises(ValueError, match="weights: dense"):
        EngineConfig(device="cuda")
    dense = EngineConfig(weights="dense", dtype="float32")
    assert dense.device == ("cuda" if torch.cuda.is_available() else "cpu")
