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


def test_the_kv_pool_is_what_is_left_of_the_memory_budget_unless_sized():
    import psutil
    total, held = psutil.virtual_memory().total, psutil.Process().memory_info().rss
    share = (held + 2**30) / total  # (this test process may hold GBs of other tests' engines)
    config = EngineConfig(memory_utilization=share)
    budget = share * total
    assert budget - held - 2**26 < config.pool_bytes() < budget - held + 2**26
    assert budget - held - 2**28 - 2**26 < config.pool_bytes(2**28) < budget - held - 2**28 + 2**26  # weights to read
    assert EngineConfig(kv_cache_mb=1).pool_bytes() == 2**20
    with pytest.raises(ValueError, match="memory_utilization"):
        EngineConfig(memory_utilization=0.0)


def test_the_shipped_local_config_is_the_default_serving_path():
    engine = load_config(default_config()).engine
    assert (engine.weights, engine.dtype, engine.kv_cache_mb) == ("auto", "auto", None)
    assert engine.memory_utilization == 0.1 and EngineSettings().memory_utilization is None  # (CPU's default)
