"""Int4 serving of the GGUF's own Q4_1 codes (weights="q4"): lossless mapping, kernels, quality."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ember.kernels.cpu_int4 import INT4_MAX_ROWS, Int4Linear, Int4Logits


@pytest.fixture(scope="module")
def q4_weights(model_path):
    from ember.model.gguf_quant import read_q4_1
    return read_q4_1(model_path)


@pytest.fixture(scope="module")
def q4_loaded(model_path):
    from ember.model.loader import load_model
    return load_model(model_path, "bfloat16", "q4")


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                                  "model.layers.29.mlp.down_proj.weight"])
def test_q4_codes_are_the_gguf_weights_exactly(q4_weights, model_path, name):
    """codes * d + m equals the fp32 checkpoint the dense path serves (Q/K rows un-permuted too)."""
    from safetensors import safe_open

    from ember.model.files import cache_dir_for
    with safe_open(str(cache_dir_for(model_path) / "model.safetensors"), "np") as f:
        dense = f.get_tensor(name)
    w = q4_weights[name]
    assert w.codes.max() <= 15 and w.codes.shape == dense.shape
    np.testing.assert_array_equal(w.dequantize(), dense)


def test_int4_linear_small_steps_use_int4_large_steps_dense(q4_weights):
    w = q4_weights["model.layers.5.mlp.gate_proj.weight"]
    exact = torch.from_numpy(w.dequantize())
    layer = Int4Linear(w.codes, w.scale, w.low, exact)
    for rows in (1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 64):
        x = torch.randn(rows, exact.shape[1]).bfloat16()
        ref = x.float() @ exact.T
        y = layer(x)
        assert y.dtype == torch.bfloat16 and y.shape == ref.shape
        # bf16 scales and outputs: relative error at the bf16 level, not more
        assert (y.float() - ref).norm() / ref.norm() < 0.01, rows
    x = torch.randn(1, exact.shape[1]).bfloat16()
    int4_only = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scales_and_zeros)
    assert torch.equal(layer(x), int4_only)  # one row really takes the int4 kernel


def test_int4_logits_rescore_nominees_exactly():
    torch.manual_seed(0)
    weight = torch.randn(4096, 64)
    head = Int4Logits(weight, candidates=32)
    x = torch.randn(1, 64).bfloat16()
    logits = head(x)
    exact = x.float() @ head.weight.float().T
    approx = torch.ops.aten._weight_int4pack_mm_for_cpu(x, head.packed, 32, head.scales_and_zeros).float()
    nominees = approx.topk(32).indices[0]
    assert torch.equal(logits[0, nominees], exact[0, nominees])
    assert int(logits.argmax()) == int(exact.argmax())
    batch = torch.randn(3, 64).bfloat16()
    assert torch.allclose(head(batch), batch.float() @ head.weight.float().T, rtol=0.02, atol=0.05)


def test_q4_quality_against_fp32_reference(loaded, q4_loaded):
    """Teacher-forced decode on the int4 path agrees with the fp32 reference almost everywhere."""
    from ember.bench.quality import compare_to_reference
    from tests.conftest import PROMPTS
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS[:4]]
    q = compare_to_reference(loaded, {"q4": q4_loaded}, prompts, new_tokens=16)["q4"]
    assert q["positions"] == 64
    assert q["top1_agreement"] >= 0.9, q
    assert q["mean_kl"] < 0.05, q


def test_q4_engine_answers_and_hashes_kv_apart(q4_loaded, engine):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    q4 = LLMEngine(EngineConfig(dtype="bfloat16", weights="q4", num_threads=2, kv_cache_bytes=32 * 2**20),
                   loaded=q4_loaded)
    prompt = q4.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = q4.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert "Paris" in out.text
    assert q4.loaded.fingerprint.endswith("+q4")
    assert q4.block_manager.root_hash != engine.block_manager.root_hash  # its KV never mixes with fp32 KV


def test_q4_needs_bf16_and_a_gguf():
    from ember.engine.config import EngineConfig
    from ember.placement.config import EngineSettings
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(weights="q4")
    with pytest.raises(ValueError, match="dense"):
        EngineConfig(weights="q8")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineSettings(weights="q4")
    from ember.model.files import check_weights
    with pytest.raises(ValueError, match="GGUF"):
        check_weights("some/folder", "bfloat16", "q4")
