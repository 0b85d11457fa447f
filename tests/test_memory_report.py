"""Memory you can account for (issue 32): each process's resident memory split into parts, each part
measured from its own source (mincore of the engine's tensors, mallinfo2, pymalloc's counters, the
file mappings in smaps), and the parts adding up to the resident size the kernel reports."""
from __future__ import annotations

import json

import psutil
import pytest

from ember.util import memory

NEW_TOKENS = 8


ONE_ENGINE = """
import json, sys
import psutil
from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.footprint import engine_memory
from ember.engine.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], weights="q4", dtype="bfloat16", threads=2, kv_cache_mb=512,
                                max_num_batched_tokens=512))
before = engine_memory(engine)
engine.add_request(list(range(1, 1501)), SamplingParams(max_tokens=8, ignore_eos=True))
while engine.has_unfinished():
    engine.step()
after = engine_memory(engine)
print(json.dumps({"before": before, "after": after, "psutil_rss": psutil.Process().memory_info().rss,
                  "block_bytes": engine.layout.block_bytes, "block_size": engine.config.block_size}))
"""


def test_an_engines_parts_add_up_and_its_kv_part_is_what_its_blocks_hold(model_path):
    """One engine in a fresh process, as an engine core runs (a test process holds many engines, whose
    untouched pools malloc counts in use: the report is for processes that hold one)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", ONE_ENGINE, str(model_path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = r["before"], r["after"]
    assert before["kv_pool"] < 2**20, "a fresh pool is not resident (zeroed pages, touched when written)"
    for report in (before, after):
        assert abs(report["unaccounted"]) <= 0.10 * report["rss"], report
    assert after["rss"] == pytest.approx(r["psutil_rss"], rel=0.05)
    written = -(-(1500 + NEW_TOKENS - 1) // r["block_size"]) * r["block_bytes"]
    # each block is a few KiB in each layer x plane region of the pool: page rounding, not 2 MiB huge pages
    assert 0.9 * written <= after["kv_pool"] - before["kv_pool"] <= 1.5 * written + 60 * memory.PAGE, (after, written)
    assert after["weights"] >= before["weights"] > 0
    assert after["workspace"] > 0  # the captured step's buffers (the default q4 path captures)


def test_the_kv_pool_is_what_is_left_of_the_engines_budget(q4_engine):
    total, before = psutil.virtual_memory().total, psutil.Process().memory_info().rss
    share = (before + 2**30) / total  # (this test process may hold GBs of other tests' engines)
    engine = q4_engine(memory_utilization=share, kv_cache_mb=None)
    held = psutil.Process().memory_info().rss
    pool = engine.cache.nbytes
    assert pool <= share * total - held + 2**24, "the pool is what the budget leaves of what the process holds"
    assert pool >= share * total - held - 2**28  # (less the mapped weights not read yet: at most their size)
    with pytest.raises(ValueError, match="leaves no room for a KV pool"):
        q4_engine(memory_utilization=0.001, kv_cache_mb=None)


def test_every_process_of_the_default_cluster_reports_parts_that_add_up(default_cluster):
    """`ember status`'s memory table: each service's /metrics reports its own process and, for an
    engine service, its engine core's; the parts sum to the resident size psutil reads, within 10%."""
    from ember.cluster.status import memory_rows, scrape
    run_dir = default_cluster.run_dir
    services = json.loads((run_dir / "services.json").read_text())
    cores = 0
    for name, info in services.items():
        if not info.get("metrics"):
            continue
        m = scrape(info["metrics"])
        pid = default_cluster.cluster.pid(name)
        processes = {"service": pid}
        if name.startswith(("prefill", "decode")):
            processes["engine-core"] = default_cluster.cluster.core(name).pid
        for process, proc_pid in processes.items():
            rss = m[f'ember:memory_resident_bytes{{process="{process}"}}']
            parts = {p: m[f'ember:memory_bytes{{part="{p}",process="{process}"}}'] for p in memory.PARTS}
            assert abs(parts["unaccounted"]) <= 0.10 * rss, (name, process, parts)
            if process == "service":  # the core's report is up to MEMORY_REFRESH_S old
                assert rss == pytest.approx(psutil.Process(proc_pid).memory_info().rss, rel=0.10), (name, process)
            else:
                cores += 1
                assert parts["weights"] > 10 * 2**20, (name, parts)
    assert cores == 2
    table = memory_rows(run_dir)
    assert {row[1] for row in table[1:]} == {"service", "engine-core"}


def test_the_exact_paths_packed_weights_are_counted_as_weights(make_engine):
    """fp32 dense weights are oneDNN-packed (opaque tensors with no address to look at): counted
    whole as weights, not as heap."""
    from ember.engine.footprint import engine_memory
    engine = make_engine(kv_cache_mb=64)
    report = engine_memory(engine)
    params = sum(p.numel() * p.element_size() for p in engine.loaded.model.parameters())
    assert report["weights"] >= 0.8 * params, (report, params)
