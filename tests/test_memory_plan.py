"""`ember plan memory` on the shipped real configs (configs/models/): parameter counts, KV bytes
per token, and which TP/PP/EP layouts of which GPUs hold Kimi K2.5 and Llama 4 Scout (torch-free)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ember.engine import workspace as ws
from ember.placement import memory_plan as mp
from ember.placement.cli import main_for_tests

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / "configs" / "models" / "kimi-k2.5.json"
SCOUT = ROOT / "configs" / "models" / "llama-4-scout.json"


@pytest.fixture(scope="module")
def kimi() -> mp.ModelShape:
    return mp.read_model_shape(KIMI)


@pytest.fixture(scope="module")
def scout() -> mp.ModelShape:
    return mp.read_model_shape(SCOUT)


def _layout(plans: list[mp.LayoutPlan], tp: int, pp: int, ep: int) -> mp.LayoutPlan:
    return next(p for p in plans if (p.layout.tp, p.layout.pp, p.layout.ep) == (tp, pp, ep))


def test_parameter_counts_are_the_checkpoints(kimi, scout):
    # transformers 5.24's DeepseekV3ForCausalLM and Llama4ForConditionalGeneration, built on the meta
    # device from these configs, count 1,026,408,209,408 and 107,769,861,120 (language model); Kimi's
    # 23,040 more are the routers' e_score_correction_bias (60 layers x 384), a buffer there
    assert kimi.total_parameters == 1_026_408_232_448
    assert scout.total_parameters == 107_769_861_120
    # the published figures: Kimi K2.5 "1T total, 32B activated", Llama 4 Scout "109B total (with its
    # vision encoder, ~0.87 B here left out), 17B active"
    assert 1.00e12 <= kimi.total_parameters <= 1.04e12
    assert kimi.active_parameters == pytest.approx(32e9, rel=0.04)
    assert scout.total_parameters == pytest.approx(109e9, rel=0.02)
    assert scout.active_parameters == pytest.approx(17e9, rel=0.03)
    parts = kimi.parameter_counts()
    assert parts["routed_experts"] == 60 * 384 * 3 * 7168 * 2048      # layer 0 is dense (first_k_dense_replace 1)
    assert parts["dense_mlp"] == 3 * 7168 * 18432
    assert parts["lm_head"] == parts["embedding"] == 163840 * 7168    # untied


def test_int4_bytes_match_the_shipped_kimi_checkpoint(kimi):
    # moonshotai/Kimi-K2.5's safetensors: 554.30 GiB (595.2 GB) in 64 files, with ~0.93 GB of vision
    # tower and projector in bf16 that the plan leaves out: int4 experts + a bf16 scale per 32, rest bf16
    text_bytes = 554.30 * mp.GIB - 0.93e9
    assert mp.total_weight_bytes(kimi, "int4") == pytest.approx(text_bytes, rel=0.005)
    assert mp.total_weight_bytes(kimi, "bf16") == pytest.approx(2 * kimi.total_parameters, rel=1e-9)


def test_kv_bytes_per_token(kimi, scout):
    assert kimi.kv_bytes_per_token("bf16") == 576 * 61 * 2 == 70_272         # (512 + 64) latent values
    assert kimi.kv_values_per_token_layer(tp=8) == 576                        # the latent is whole on every rank
    assert scout.kv_bytes_per_token("bf16") == 2 * 8 * 128 * 48 * 2 == 196_608
    assert scout.kv_values_per_token_layer(tp=2) == 2 * 4 * 128               # split by KV heads...
    assert scout.kv_values_per_token_layer(tp=16) == 2 * 1 * 128              # ...and replicated beyond 8


def test_a_gpu_is_what_cuda_reports_less_a_stated_runtime():
    # torch.cuda.get_device_properties / mem_get_info totals (nvidia-smi's 81,559 and 143,771 MiB include what
    # the driver keeps), and the runtime named term by term, not a fraction
    assert mp.parse_hardware("H100x8") == mp.Hardware("H100", 8, 81_082)
    assert mp.parse_hardware("h200x2").memory_bytes == 143_156 * 2**20
    assert [t.name for t in ws.gpu_runtime(1)] == ["CUDA context, kernels, cuBLAS workspaces", "allocator slack"]
    assert sum(t.nbytes for t in ws.gpu_runtime(8)) == 2.5 * mp.GIB                  # + the communicators


def test_kimi_k25_int4_fits_eight_h100_with_over_30_gib_of_kv(kimi):
    """Infire's figure (Kimi K2.5 on 8 x H100, > 30 GiB left for KV), checked with the whole GPU as CUDA
    reports it, a stated runtime and the step's workspace at the engine's limits: every layout of 8 fits;
    TP=8 EP=8 keeps 5.0 GiB of KV a GPU (the MLA latent whole on each), 40 GiB over the node. The int4
    weights alone overfill 6 H100s; bf16 (2.05 TB) does not come close on 8."""
    assert mp.gpus_for_weights(kimi, "H100", "int4") == 7
    assert not any(p.fits for p in mp.plan_memory(kimi, mp.parse_hardware("H100x4"), "int4"))
    eight = mp.plan_memory(kimi, mp.parse_hardware("H100x8"), "int4")
    assert [str(p.layout) for p in eight] == ["TP=1 PP=8 EP=1", "TP=2 PP=4 EP=1", "TP=2 PP=4 EP=2", "TP=4 PP=2 EP=1",
                                              "TP=4 PP=2 EP=4", "TP=8 PP=1 EP=1", "TP=8 PP=1 EP=8"]
    assert all(p.fits for p in eight)
    tp8 = _layout(eight, 8, 1, 8)
    assert tp8.weight_bytes == pytest.approx(76.2e9, rel=0.005)
    # the arithmetic closes: capacity - runtime - weights - workspace = the KV pool, every rank alike
    assert tp8.kv_pool_bytes == tp8.capacity_bytes - tp8.runtime_bytes - tp8.weight_bytes - tp8.workspace_bytes
    pp8 = _layout(eight, 1, 8, 1)                                          # the tightest stage's own weights
    assert pp8.kv_pool_bytes == pp8.capacity_bytes - pp8.runtime_bytes - pp8.tightest_weight_bytes \
        - pp8.workspace_bytes and pp8.kv_pool_bytes == pytest.approx(3.0 * mp.GIB, rel=0.01)
    assert tp8.kv_node_bytes == 8 * tp8.kv_pool_bytes and tp8.kv_node_bytes >= 30 * mp.GIB
    assert tp8.context_tokens == int(tp8.kv_pool_bytes // 70_272) > 70_000
    terms = {t.name: t.nbytes for t in tp8.workspace.terms}
    assert terms["MoE dispatch rows"] == 1024 * 8 * 7168 * 2               # tokens x top_k x hidden, bf16
    assert terms["MoE slots all-reduce"] == 1024 * 8 * 7168 * 2
    assert terms["logits"] == 64 * (163840 // 8) * (2 + 4)                 # max_num_seqs rows x vocab/rank
    assert 0.4 * mp.GIB < tp8.workspace_bytes < 1.0 * mp.GIB and tp8.workspace.largest_phase == "moe"
    # the step the engine is configured for sizes it: 8x the batched tokens costs the node ~30 GiB of KV
    big = mp.Budget(limits=ws.StepLimits(8192, 64, cuda_graph_sizes=(64,)))
    big_tp8 = _layout(mp.plan_memory(kimi, mp.parse_hardware("H100x8"), "int4", big), 8, 1, 8)
    assert big_tp8.workspace_bytes > 7 * tp8.workspace_bytes and big_tp8.kv_node_bytes < 11 * mp.GIB
    # the old flat budget (0.9 x 80 GB less 4 GiB) is still there on request, and says no
    flat = mp.plan_memory(kimi, mp.Hardware("H100", 8, 76_294), "int4", mp.Budget(0.9, 4 * mp.GIB))
    assert not any(p.fits for p in flat)
    assert not any(p.fits for p in mp.plan_memory(kimi, mp.parse_hardware("H100x8"), "bf16"))
    h200 = mp.plan_memory(kimi, mp.parse_hardware("H200x8"), "int4")
    assert all(p.fits for p in h200) and _layout(h200, 8, 1, 8).context_tokens > 600_000


def test_llama4_scout_holds_a_million_tokens_on_two_h200(scout):
    """Infire's Scout on 2 x H200 (~1.2M tokens): bf16 (215.5 GB) at TP=2 leaves 36.7 GiB of KV a GPU; with
    every layer holding every token that is 401,255 tokens, but the 36 chunked-attention layers keep only
    each running sequence's current 8,192-token chunk, so the 12 full layers hold 1.4M tokens over 8
    sequences (1.58M over one; 64 sequences' windows leave almost nothing)."""
    plans = mp.plan_memory(scout, mp.parse_hardware("H200x2"), "bf16")
    tp2 = _layout(plans, 2, 1, 1)
    assert all(p.fits for p in plans) and tp2.kv_bytes_per_token == 98_304
    assert 36 * mp.GIB < tp2.kv_pool_bytes < 37.5 * mp.GIB and tp2.context_tokens > 390_000
    per_layer = 2 * 4 * 128 * 2                                            # K and V, 4 KV heads a rank, bf16
    windows = 36 * per_layer * (8 * 8192 + 1024)
    assert tp2.chunk_window_bytes == windows
    assert tp2.hybrid_tokens == int((tp2.kv_pool_bytes - windows) // (12 * per_layer)) >= 1_000_000
    one = mp.plan_layout(scout, mp.parse_hardware("H200x2"), mp.Layout(2, 1, 1), "bf16", mp.Budget(sequences=1))
    many = mp.plan_layout(scout, mp.parse_hardware("H200x2"), mp.Layout(2, 1, 1), "bf16", mp.Budget(sequences=64))
    assert one.hybrid_tokens > 1_500_000 > tp2.hybrid_tokens > 1_000_000 > 100_000 > many.hybrid_tokens
    h200 = mp.plan_memory(scout, mp.parse_hardware("H200x1"), "bf16")
    assert len(h200) == 1 and not h200[0].fits and "weights 215.5 GB" in h200[0].reason
    assert mp.plan_memory(scout, mp.parse_hardware("H200x1"), "fp8")[0].fits


def test_tied_embeddings_and_pipeline_stages_per_rank():
    config = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, "tie_word_embeddings": True}
    shape = mp.model_shape(config)
    layer = 2 * 64 * 64 + 2 * 64 * 32 + 2 * 64 + 3 * 64 * 128                  # q+o, k+v, 2 norms, MLP
    assert shape.total_parameters == 2 * layer + 100 * 64 + 64                  # a tied lm_head counts once
    tp2 = mp.plan_layout(shape, mp.Hardware("H100", 2, 81_082), mp.Layout(2, 1, 1), "bf16")
    assert tp2.weight_bytes == 2 * (2 * (layer - 128) / 2 + 2 * 128 + 100 * 64 / 2 + 64)
    pp2 = mp.plan_layout(shape, mp.Hardware("H100", 2, 81_082), mp.Layout(1, 2, 1), "bf16")
    assert pp2.weight_bytes == 2 * (layer + 100 * 64 + 64)                      # the last stage's own lm_head copy
    assert mp.stages(61, 2) == [range(0, 31), range(31, 61)]


def test_a_config_it_cannot_read_is_refused_naming_the_field(tmp_path, capsys):
    config = json.loads(KIMI.read_text())
    del config["text_config"]["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json lacks text_config\.kv_lora_rank"):
        mp.read_model_shape(tmp_path)
    assert main_for_tests(["plan", "memory", "--model-config", str(tmp_path / "config.json"),
                           "--hardware", "H100x8"]) == 2
    assert "error: config.json lacks text_config.kv_lora_rank" in capsys.readouterr().err
    config["text_config"]["kv_lora_rank"] = "512"
    with pytest.raises(ValueError, match=r"text_config\.kv_lora_rank is '512', not a positive integer"):
        mp.model_shape(config)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not one memory plans read"):
        mp.model_shape({"model_type": "gpt2"})
    (tmp_path / "broken.json").write_text("{")
    assert main_for_tests(["plan", "memory", "--model-config", str(tmp_path / "broken.json"),
                           "--hardware", "H100x8"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not <GPU>x<count>"):
        mp.parse_hardware("H300x8")
    assert mp.parse_hardware("l40sx4") == mp.Hardware("L40S", 4, 45_589)


def test_plan_without_what_is_still_the_workers_plan(capsys):
    assert main_for_tests(["plan"]) == 2                                        # --config/--trace: by hand now
    assert "ember plan (workers) needs --config and --trace" in capsys.readouterr().err
    assert main_for_tests(["plan", "memory", "--hardware", "H100x8"]) == 2
    assert "needs --model-config" in capsys.readouterr().err


def test_ember_plan_memory_prints_the_fits(tmp_path, capsys):
    assert main_for_tests(["plan", "memory", "--model-config", str(SCOUT), "--hardware", "H200x2",
                           "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "KV per token (bf16): 2048 values x 48 layers x 2 B = 196,608 B" in out
    assert "H200x2: 2 x 143,156 MiB as CUDA reports it = 139.80 GiB a GPU" in out
    assert "TP=2 PP=1 EP=1  107.8            0.19           36.74        73.5         98,304           401,255" in out
    assert "verdict: fits H200x2 in 3 of 3 layouts" in out
    assert "MoE dispatch rows: 2 x 1024 tokens x 1 top_k x 5120 x 2 B = 20.0 MiB" in out
    assert "/ 24,576 B a token = 1,405,343 context tokens" in out
    # the real command line, as a user runs it
    run = subprocess.run([sys.executable, "-m", "ember.cli", "plan", "memory", "--model-config", str(KIMI),
                          "--hardware", "H100x8", "--json", str(tmp_path / "plan.json")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "KV per token (bf16): 576 values x 61 layers x 2 B = 70,272 B" in run.stdout
    assert "verdict: fits H100x8 in 7 of 7 layouts" in run.stdout
    assert ("runtime a GPU: CUDA context, kernels, cuBLAS workspaces 1.00 GiB + communicators (NCCL) 1.00 GiB"
            in run.stdout)
    assert "fewest H100: the weights alone need 7 (594.2 GB); within the budget above, 8" in run.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [d["dtype"] for d in plan["dtypes"]] == ["bf16", "fp8", "int4"]
    int4 = plan["dtypes"][2]
    assert all(layout["fits"] for layout in int4["layouts"]) and int4["smallest_fit"]["gpus"] == 8
    tp8 = next(x for x in int4["layouts"] if (x["tp"], x["ep"]) == (8, 8))
    assert tp8["kv_pool_bytes_node"] >= 30 * mp.GIB and any(t["name"] == "MoE dispatch rows"
                                                              for t in tp8["workspace_terms"])
    assert plan["kv_bytes_per_token"] == 70_272 and plan["total_parameters"] == 1_026_408_232_448


def test_memory_plans_stay_torch_free():
    code = ("import sys\n"
            "from ember.placement.cli import main_for_tests\n"
            f"args = ['plan', 'memory', '--model-config', {str(SCOUT)!r}, '--hardware', 'H200x2']\n"
            "assert main_for_tests(args) == 0\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True, cwd=ROOT)


def _step_peak_bytes(run_step) -> int:
    """The most bytes torch held at once, over what it held before, while `run_step` ran: its allocations
    and frees in order, as torch's profiler records them (an exact count, whatever the host's load)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        events = json.loads(Path(trace.name).read_text())["traceEvents"]
    held = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        held += event["args"]["Bytes"]
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("kind, dtype", [("qwen3", "float32"), ("deepseek_v3", "float32"), ("llama4", "float32"),
                                         ("llama4", "bfloat16")])
def test_the_workspace_model_predicts_the_engines_measured_step_peak(kind, dtype, tmp_path_factory, model_path):
    """The engine sizes its KV pool around ember.engine.workspace's figure (engine_workspace, what `ember plan
    memory` prints for a GPU): a small random model of each attention kind (GQA with QK-norm; MLA with routed
    experts; Llama 4's chunked layers and input-scaled experts, in fp32 on SDPA and in bf16 on the
    batch-invariant recipe) runs one step at its max_num_batched_tokens,
    a prefill chunk against as many cached tokens (the torch recipes' worst: context gather, masks, MLA's
    scores), and one decode step of max_num_seqs sequences (the logits' worst), and torch's own count of
    the step's peak is within [0.6, 1.4] of the model (measured here: 0.81-1.13)."""
    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    from ember.model.args import read_model_args
    from ember.model.files import model_folder
    from tests.families import build
    folder = build(kind, tmp_path_factory.mktemp("families") / kind, model_folder(str(model_path)))
    if dtype == "bfloat16":
        terms = ws.engine_workspace(read_model_args(folder), SimpleNamespace(
            device="cpu", dtype=dtype, weights="dense", attention_backend="cpp", speculative_tokens=0,
            max_num_batched_tokens=512, max_num_seqs=1, capture_sizes=[1], enforce_eager=False, optimize=True),
            1024).terms
        assert "block partials and their sum" in [t.name for t in terms]   # (the chunked layers' recipe)

    def engine(tokens: int, seqs: int) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(folder), dtype=dtype, weights="dense", threads=2, kv_cache_mb=64,
                                      max_num_batched_tokens=tokens, max_num_seqs=seqs, speculative_tokens=0,
                                      max_model_len=2048))

    prefill = engine(512, 1)
    prefill.add_request(list(range(100, 1124)), SamplingParams(max_tokens=1, ignore_eos=True))
    prefill.step()                                                   # the first 512 tokens, then 512 more on them
    measured = _step_peak_bytes(prefill.step)
    assert prefill.stats.num_computed_tokens == 1024
    predicted = ws.engine_workspace(prefill.loaded.args, prefill.config, 1024)
    assert predicted.largest_phase == "attention"
    assert 0.6 <= measured / predicted.peak_bytes <= 1.4, (measured, ws.describe(predicted))

    decode = engine(32, 32)
    for i in range(32):  # (none finishes before the last prompt is in: the step policy may interleave them)
        decode.add_request([100 + i] * 16, SamplingParams(max_tokens=64, ignore_eos=True))
    deadline = 64
    while deadline and not all(seq.num_computed_tokens >= seq.prompt_len for seq in decode.seqs.values()):
        decode.step()                                                # every prompt in (2 a step), then decode
        deadline -= 1
    before = decode.stats.num_computed_tokens
    measured = _step_peak_bytes(decode.step)
    assert decode.stats.num_computed_tokens - before == 32           # one token for each of 32 sequences
    predicted = ws.engine_workspace(decode.loaded.args, decode.config, 24)
    assert predicted.largest_phase == "logits"                       # 32 rows x 49,152 vocab x 4 B
    assert 0.6 <= measured / predicted.peak_bytes <= 1.4, (measured, ws.describe(predicted))
