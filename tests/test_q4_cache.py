"""The int4 kernel's packed weights, cached on disk once per GGUF (ember.model.q4_cache): the cached
load serves the bits of packing from the GGUF itself, engines on one host share the mapped pages,
and a changed source file is packed again."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from ember.engine.sampling_params import SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def native(model_path):
    from ember.kernels import cpu_q4
    if not cpu_q4.fits(64, 32):
        pytest.skip("the C++ kernels do not build here (test_paged_attention.py's build test fails instead)")
    if model_path.suffix != ".gguf":
        pytest.skip("the packed cache is made from a GGUF (EMBER_TEST_MODEL is an HF folder)")


def test_the_cached_packs_serve_the_bits_of_packing_the_gguf(native, model_path, q4_loaded, q4_engine, monkeypatch):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.model import loader, q4_cache
    assert q4_cache.cached(model_path) is not None, "the session's q4 load made the cache"
    monkeypatch.setattr(loader, "_cached_packs", lambda path: None)  # pack from the GGUF, as before the cache
    repacked = loader.load_model(model_path, "bfloat16", "q4")
    assert repacked.weights_bytes == q4_loaded.weights_bytes and repacked.fingerprint == q4_loaded.fingerprint
    fresh = LLMEngine(EngineConfig(dtype="bfloat16", weights="q4", threads=2, kv_cache_mb=64), loaded=repacked)
    params = SamplingParams(max_tokens=12, logprobs=2)
    prompts = [fresh.tokenizer.encode(p) for p in PROMPTS[:3]]
    want, got = fresh.generate(prompts, params), q4_engine().generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert all(len(g.logprobs) == 12 for g in got)
    assert [g.logprobs for g in got] == [w.logprobs for w in want], "the same bits, not only the same argmax"


def test_two_engines_on_one_host_share_the_mapped_packs(native, model_path):
    """Each process maps the file; the pages it has read are the page cache's, shared, not copies."""
    from ember.model import q4_cache
    packed = str(q4_cache.ensure(model_path))
    script = textwrap.dedent(f"""
        import sys
        from ember.engine.config import EngineConfig
        from ember.engine.engine import LLMEngine
        e = LLMEngine(EngineConfig(model={str(model_path)!r}, weights="q4", threads=1, kv_cache_mb=16))
        from ember.engine.sampling_params import SamplingParams
        e.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # every layer's pages read once
        print("ready", flush=True)
        sys.stdin.read()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            rss, shared = _mapping_kb(p.pid, packed)
            assert rss > 30_000, f"the packed weights ({rss} kB resident) are read from the mapping"
            assert shared >= 0.9 * rss, f"{shared} of {rss} kB shared: the two engines hold one copy"
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)


def _mapping_kb(pid: int, path: str) -> tuple[int, int]:
    """Resident and shared kB of `pid`'s mappings of `path` (/proc/PID/smaps)."""
    rss = shared = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                inside = fields[-1] == path
            elif inside and fields[0] == "Rss:":
                rss += int(fields[1])
            elif inside and fields[0] in ("Shared_Clean:", "Shared_Dirty:"):
                shared += int(fields[1])
    return rss, shared


def test_a_changed_source_is_packed_again(native, model_path, tmp_path):
    from ember.model import q4_cache
    from ember.model.files import cache_dir_for
    copy = tmp_path / model_path.name
    shutil.copy2(model_path, copy)  # the same size and mtime: the real caches are valid for it
    shutil.copytree(cache_dir_for(model_path), cache_dir_for(copy), copy_function=os.link)
    assert q4_cache.cached(copy) == cache_dir_for(copy) / q4_cache.FILE
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the source changed
    assert q4_cache.cached(copy) is None
    rebuilt = q4_cache.ensure(copy)
    assert rebuilt == cache_dir_for(copy) / q4_cache.FILE and q4_cache.cached(copy) == rebuilt
    assert os.stat(rebuilt).st_ino != os.stat(q4_cache.ensure(model_path)).st_ino, "a new file, not the old link"
    assert q4_cache.cached(model_path) is not None, "the original's cache is untouched"


def test_the_cache_key_names_the_kernels_layout():
    """The cache is keyed by the kernel's quad width without importing torch: the two constants are one."""
    from ember.kernels.cpu_q4 import QUAD
    from ember.model import q4_cache
    assert q4_cache.QUAD == QUAD
