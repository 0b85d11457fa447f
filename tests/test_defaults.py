"""The shipped defaults: a Q4_1 GGUF serves its own codes (q4, bf16) unless the exact path is asked for;
the KV pool follows available memory; the shipped configs say so."""
from __future__ import annotations

import pytest

from ember.cluster.launcher import default_config
from ember.config.load import load_config
from ember.engine.config import EngineConfig, EngineSettings
from ember.model.files import resolve_serving


def test_a_q4_1_gguf_serves_its_codes_by_default_and_dense_means_the_exact_path(model_path):
    assert resolve_serving(model_path) == ("bfloat16", "q4")
    config = EngineConfig(model=str(model_path))
    assert (config.dtype, config.weights) == ("bfloat16", "q4")
    exact = EngineConfig(model=str(model_path), weights="dense")
    assert (exact.dtype, exact.weights) == ("float32", "dense")
    assert resolve_serving(model_path, dtype="float32") == ("float32", "dense")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(model=str(model_path), weights="q4", dtype="float32")
    with pytest.raises(ValueError, match="bfloat16"):
        EngineSettings(weights="q4", dtype="float32")


def test_an_hf_folder_serves_dense_in_its_checkpoint_dtype(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert resolve_serving(tmp_path) == ("bfloat16", "dense")
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert resolve_serving(tmp_path) == ("float32", "dense")


def test_the_kv_pool_follows_available_memory_unless_sized():
    import psutil
    config = EngineConfig(kv_cache_memory_fraction=0.05)
    available = psutil.virtual_memory().available
    assert 0.8 * 0.05 * available < config.pool_bytes() < 1.2 * 0.05 * available
    assert EngineConfig(kv_cache_mb=1).pool_bytes() == 2**20
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(kv_cache_memory_fraction=0.0)


def test_the_shipped_local_config_is_the_default_serving_path():
    engine = load_config(default_config()).engine
    assert (engine.weights, engine.dtype, engine.kv_cache_mb) == ("auto", "auto", None)
    assert engine.kv_cache_memory_fraction == EngineSettings().kv_cache_memory_fraction
