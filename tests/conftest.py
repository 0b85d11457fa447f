"""Shared fixtures: the real default model, one engine, and the transformers reference."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from ember.model.fetch import DEFAULT_MODEL_PATH, fetch_default_model

LONG_TEXT = " ".join(
    f"Section {i}. The harbour town of Eastmere kept its records in a stone archive by the quay. "
    f"In year {1700 + 7 * i} the council counted {40 + i} fishing boats, {3 * i + 2} merchant ships "
    f"and a lighthouse whose keeper wrote down the weather every morning. Storms came from the west, "
    f"and the keeper's notes say the tide rose higher than anyone remembered."
    for i in range(20)
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 3?\nA:",
    "The three primary colours are",
    # ChatML as the model's template renders it: the model answers at length (24+ tokens)
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n" + LONG_TEXT + "\n\nWhat did the lighthouse keeper write down every morning?<|im_end|>\n"
    "<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def model_path() -> Path:
    # EMBER_TEST_MODEL: an HF folder in place of the default GGUF (the GPU machine cannot fetch it:
    # scripts/gpu-check.sh makes a random-weights one); tests that need the GGUF's own file skip
    if os.environ.get("EMBER_TEST_MODEL"):
        return Path(os.environ["EMBER_TEST_MODEL"])
    return fetch_default_model(DEFAULT_MODEL_PATH)


@pytest.fixture(scope="session")
def loaded(model_path):
    from ember.model.loader import load_model
    return load_model(model_path)


@pytest.fixture(scope="session")
def q4_loaded(model_path):
    """The default serving path's model: the GGUF's Q4_1 codes on int4 kernels, bf16."""
    from ember.model.loader import load_model
    return load_model(model_path, "bfloat16", "q4")


@pytest.fixture(scope="session")
def q4_engine(q4_loaded):
    """make(**overrides): a fresh engine on the q4 weights (own pool, scheduler and cache)."""
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine

    def make(**overrides):
        config = dict(dtype="bfloat16", weights="q4", threads=2, kv_cache_mb=256) | overrides
        return LLMEngine(EngineConfig(**config), loaded=q4_loaded)
    return make


@pytest.fixture(scope="session")
def engine(loaded):
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(dtype="float32", weights="dense", kv_cache_mb=256, threads=2),
                     loaded=loaded)


@pytest.fixture(scope="session")
def make_engine(loaded):
    """A fresh engine on the already-loaded weights (own pool, scheduler and cache)."""
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine

    def make(**overrides) -> LLMEngine:
        overrides.setdefault("threads", 2)
        overrides.setdefault("dtype", "float32")  # the exact path, like `loaded`
        overrides.setdefault("weights", "dense")
        overrides.setdefault("kv_cache_mb", 512)
        return LLMEngine(EngineConfig(**overrides), loaded=loaded)
    return make


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own GGUF loader and tokenizer: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = model_path.suffix == ".gguf"
    folder, kw = (model_path.parent, dict(gguf_file=model_path.name)) if gguf else (model_path, {})
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    return tok, model


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(token_ids, max_new_tokens) -> generated ids (memoised)."""
    import torch
    tok, model = hf_model
    memo: dict = {}

    def run(token_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(token_ids), max_new_tokens)
        if key not in memo:
            with torch.inference_mode():
                out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones(1, len(token_ids), dtype=torch.long))
            memo[key] = out[0, len(token_ids):].tolist()
        return memo[key]
    return run


@pytest.fixture(scope="session")
def session_clusters(tmp_path_factory, model_path):
    """The session clusters by config, one up at a time (tests/clusters.py)."""
    from tests.clusters import SessionClusters
    pool = SessionClusters(tmp_path_factory.mktemp("clusters"), str(model_path))
    yield pool
    pool.close()


def _session_cluster(kind: str):
    @pytest.fixture(scope="module", name=f"{kind}_cluster")
    def fixture(session_clusters):
        return session_clusters.get(kind)
    fixture.__doc__ = f"The session's {kind!r} cluster (tests/clusters.py), reset to its start state for this module."
    return fixture


exact_cluster = _session_cluster("exact")
default_cluster = _session_cluster("default")
ha_cluster = _session_cluster("ha")


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers), each worker draws its ports from a range of
    its own (EMBER_PORT_RANGE, ember.cluster.ports), so two workers never hand out one port."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        n = int(worker.removeprefix("gw"))
        os.environ["EMBER_PORT_RANGE"] = f"{20000 + 3000 * (n % 4)}-{20000 + 3000 * (n % 4) + 2999}"


def pytest_collection_modifyitems(session, config, items):
    """The modules of one session cluster run together (a stable sort: the rest keeps its order), so
    each cluster starts once; under `--dist loadgroup` they run first, as one unit of work for one xdist
    worker (the longest, "session-clusters"), while every other module is a unit of its own (its
    module-scoped fixtures, a private cluster say, set up once)."""
    from tests.clusters import FIXTURES
    kinds = list(FIXTURES)

    def group(item) -> int:
        used = [kinds.index(f) for f in item.fixturenames if f in FIXTURES]
        return min(used) if used else len(kinds)
    items.sort(key=group)
    if getattr(config.option, "loadgroup", False):  # (set on xdist's workers, where --dist reads "no")
        # xdist's scheduler reads a unit from the node id (NODEID@UNIT). Its own renaming of items marked
        # xdist_group (setting item._nodeid) no longer takes since pytest 9 builds node ids from Node._id.
        from _pytest.nodeid import coerce_node_id
        for item in items:
            unit = "session-clusters" if group(item) < len(kinds) else item.nodeid.split("::")[0]
            item._id = coerce_node_id(f"{item.nodeid}@{unit}")


@pytest.fixture(scope="module")
def shared_cluster(exact_cluster):
    """The exact cluster's addresses (tests/cluster_fixture.write_config), plus `config` (the YAML) and
    `run_dir`."""
    return exact_cluster.as_dict()


def openai_client(http_address: str):
    """The official `openai` client on a router's HTTP API (no retries: a failure shows)."""
    import openai
    return openai.OpenAI(base_url=f"http://{http_address}/v1", api_key="unused", max_retries=0, timeout=180)


# -- a measurement can have the host to itself (tests/host_lock.py): every item holds it shared ---------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from tests.host_lock import shared
    with shared():
        return (yield)


# -- durations kept: `make test` sets EMBER_TEST_DURATIONS, .ci/run prints the file --------------------
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    nodeid = report.nodeid.split("@")[0]  # (less the xdist unit)
    _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    """Every test's seconds (setup + call + teardown) and each file's total, slowest first (written by
    the controller, which hears every worker's reports)."""
    path = os.environ.get("EMBER_TEST_DURATIONS")
    if not path or not _durations or hasattr(session.config, "workerinput"):
        return
    files: dict[str, float] = {}
    for nodeid, seconds in _durations.items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + seconds
    lines = [f"# {len(_durations)} tests, {sum(_durations.values()):.0f} s in tests (pytest exit {exitstatus})",
             "# by file"] + [f"{s:8.1f}  {f}" for f, s in sorted(files.items(), key=lambda kv: -kv[1])]
    lines += ["# by test"] + [f"{s:8.1f}  {n}" for n, s in sorted(_durations.items(), key=lambda kv: -kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")
