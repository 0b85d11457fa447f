"""The mission models' checkpoints as published load from their folders: Kimi K2.5's int4 experts
(compressed-tensors pack-quantized, written by compressed-tensors' own compressor) and DeepSeek-V3's
block-scaled FP8, sharded with an index. On the exact path (fp32) their greedy tokens equal
transformers' on the weights the format stands for (its own dequantization), alone and batched with
chunked prefill; every other format, and a missing tensor, is refused with a message naming what was
found and what is served (one line on the CLI, before any process starts at `ember up`)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ember.bench.published_formats import FP8_CONFIG, int4_quantization_config, quantize_fp8, write_published
from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams
from ember.model.checkpoint import Checkpoint, MissingTensorError, dequantize_fp8
from ember.model.quant_config import QuantizationError, parse_quantization
from tests.conftest import PROMPTS
from tests.families import build

STEPS = 24
FORMATS = ("int4", "fp8")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, model_path):
    """fmt -> (published checkpoint, dense folder of the weights it stands for)."""
    from ember.model.files import model_folder
    root = tmp_path_factory.mktemp("published")
    dense = build("deepseek_v3", root / "dense", model_folder(str(model_path)))
    return {fmt: write_published(dense, root, fmt) for fmt in FORMATS}


@pytest.fixture(scope="module")
def prompts(folders):
    from ember.model.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(folders["int4"][0])
    return [tokenizer.encode(p) for p in PROMPTS[:4]] + [tokenizer.encode(PROMPTS[-1])[:100]]  # (7 blocks)


@pytest.fixture(scope="module")
def expected(folders, prompts):
    """fmt -> transformers' greedy tokens for each prompt, on the dequantized weights."""
    from transformers import AutoModelForCausalLM
    out = {}
    for fmt, (_, reference) in folders.items():
        model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
        with torch.inference_mode():
            out[fmt] = [model.generate(torch.tensor([ids]), max_new_tokens=STEPS, min_new_tokens=STEPS,
                                       do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long)
                                       )[0, len(ids):].tolist() for ids in prompts]
    return out


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, ignore_eos=True)


def engine_for(folder: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(**(dict(model=str(folder), dtype="float32", weights="dense", threads=2,
                                          kv_cache_mb=64) | overrides)))


def test_the_published_folders_are_what_the_formats_store(folders):
    int4, _ = folders["int4"]
    names = set(json.loads((int4 / "model.safetensors.index.json").read_text())["weight_map"])
    expert = "model.layers.1.mlp.experts.0.gate_proj"
    assert {f"{expert}.weight_packed", f"{expert}.weight_scale", f"{expert}.weight_shape"} <= names
    assert f"{expert}.weight" not in names and "model.layers.1.self_attn.kv_b_proj.weight" in names
    fp8, _ = folders["fp8"]
    ckpt = Checkpoint(fp8)
    assert ckpt.form("model.layers.0.self_attn.kv_b_proj.weight") == "fp8"
    assert ckpt.form("model.layers.1.mlp.gate.weight") == "dense"  # the router stays as it is
    assert len(ckpt.files) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_published_checkpoint_reads_as_the_weights_it_stands_for(fmt, folders):
    from safetensors.torch import load_file
    quantized, reference = folders[fmt]
    ours = Checkpoint(quantized).read_all(torch.float32)
    theirs = load_file(reference / "model.safetensors")
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_alone_each_prompt_gives_transformers_tokens(fmt, folders, prompts, expected):
    engine = engine_for(folders[fmt][0])
    for ids, want in zip(prompts, expected[fmt]):
        [out] = engine.generate([ids], greedy())
        assert out.token_ids == want, f"{fmt}: a prompt of {len(ids)} tokens diverged"


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_and_chunked_give_transformers_tokens(fmt, folders, prompts, expected):
    outs = engine_for(folders[fmt][0], max_num_batched_tokens=16).generate(prompts, greedy())
    assert [o.token_ids for o in outs] == expected[fmt]


def test_fp8_blocks_at_the_edges_are_partial():
    torch.manual_seed(0)
    w = torch.randn(70, 45)
    stored, equal = quantize_fp8(w, block=32)
    assert stored["weight_scale_inv"].shape == (3, 2)
    ours = dequantize_fp8(stored["weight"], stored["weight_scale_inv"], (32, 32))
    assert torch.equal(ours, equal)
    naive = torch.empty_like(w)
    for r in range(70):
        for c in range(45):
            naive[r, c] = stored["weight"][r, c].float() * stored["weight_scale_inv"][r // 32, c // 32]
    assert torch.equal(ours, naive)


# -- refusals ---------------------------------------------------------------------------------------------

def _ct(**weights) -> dict:
    q = int4_quantization_config()
    q["config_groups"]["group_0"]["weights"] |= weights
    return q


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "quant_method 'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "quant_method 'gptq'"),
    "mxfp4": ({"quant_method": "mxfp4"}, "quant_method 'mxfp4'"),
    "nvfp4": (int4_quantization_config() | {"format": "nvfp4-pack-quantized"},
              "compressed-tensors format 'nvfp4-pack-quantized'"),
    "asymmetric": (_ct(symmetric=False), "asymmetric weights"),
    "int8": (_ct(num_bits=8), "weights of 8 bits"),
    "channel": (_ct(strategy="channel", group_size=None), "strategy 'channel'"),
    "w4a8": ({**int4_quantization_config(), "config_groups": {"group_0": {
        **int4_quantization_config()["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
        "quantizes input_activations"),
    "fp8-static": (FP8_CONFIG | {"activation_scheme": "static"}, "activation_scheme 'static'"),
    "fp8-per-tensor": ({k: v for k, v in FP8_CONFIG.items() if k != "weight_block_size"},
                       "weight_block_size None"),
    "fp8-e5m2": (FP8_CONFIG | {"fmt": "e5m2"}, "fmt 'e5m2'"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_unserved_format_is_refused_naming_it_and_what_is_served(case):
    config, found = REFUSED[case]
    with pytest.raises(QuantizationError) as e:
        parse_quantization({"architectures": ["DeepseekV3ForCausalLM"], "quantization_config": config})
    message = str(e.value)
    assert found in message and "compressed-tensors pack-quantized int4" in message and "fp8 e4m3" in message
    assert "\n" not in message


def test_the_served_formats_parse_from_a_kimi_style_wrapper():
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "quantization_config": int4_quantization_config(),
            "text_config": {"model_type": "deepseek_v3"}}
    scheme = parse_quantization(kimi)
    assert (scheme.num_bits, scheme.group_size) == (4, 32)
    assert scheme.quantizes("language_model.model.layers.3.mlp.experts.17.down_proj")
    for kept in ("lm_head", "language_model.model.layers.3.self_attn.q_a_proj",
                 "language_model.model.layers.3.mlp.shared_experts.up_proj", "model.layers.0.mlp.gate_proj"):
        assert not scheme.quantizes(kept), kept
    assert parse_quantization({"quantization_config": FP8_CONFIG}).block == (128, 128)


def _broken_copy(src: Path, dst: Path, drop: str) -> Path:
    """A copy of the sharded checkpoint `src` without the tensor `drop` (as a truncated download would be)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    file = dst / index["weight_map"].pop(drop)
    tensors = load_file(file)
    del tensors[drop]
    save_file(tensors, str(file))
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def test_a_missing_tensor_is_named_with_the_form_it_was_looked_for_in(folders, tmp_path):
    expert = "model.layers.1.mlp.experts.3.up_proj"
    broken = _broken_copy(folders["int4"][0], tmp_path / "no-scale", f"{expert}.weight_scale")
    with pytest.raises(MissingTensorError, match=f"'{expert}.weight_scale'"):
        Checkpoint(broken)
    gone = tmp_path / "no-expert"
    _broken_copy(broken, gone, f"{expert}.weight_packed")
    (gone / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        k: v for k, v in json.loads((gone / "model.safetensors.index.json").read_text())["weight_map"].items()
        if not k.startswith(expert)}}))
    with pytest.raises(MissingTensorError, match=f"'{expert}.weight'.*{expert}.weight_packed"):
        engine_for(gone)


def test_the_cli_refuses_in_one_line_and_ember_up_before_starting_anything(folders, tmp_path):
    awq = tmp_path / "awq"
    shutil.copytree(folders["int4"][0], awq)
    config = json.loads((awq / "config.json").read_text())
    config["quantization_config"] = REFUSED["awq"][0]
    (awq / "config.json").write_text(json.dumps(config))
    gen = subprocess.run([sys.executable, "-m", "ember.cli", "generate", "--model", str(awq), "hello"],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 2 and "Traceback" not in gen.stderr
    assert gen.stderr.strip().count("\n") == 0 and "quant_method 'awq'" in gen.stderr
    import yaml
    shipped = yaml.safe_load((Path(__file__).parent.parent / "configs" / "local.yaml").read_text())
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(shipped | {"model": str(awq)}))
    run_dir = tmp_path / "run"
    up = subprocess.run([sys.executable, "-m", "ember.cli", "up", "--config", str(cluster), "--run-dir", str(run_dir)],
                        capture_output=True, text=True, timeout=120)
    assert up.returncode == 2 and "Traceback" not in up.stderr and "quant_method 'awq'" in up.stderr
    assert not list(run_dir.glob("*.pid")) and not (run_dir / "pids.json").exists()


# -- Kimi's int4 experts served as int4 (weights: q4, the default for such a checkpoint) ------------------

def test_kimi_int4_experts_stay_int4_and_are_the_checkpoints_codes(folders):
    from ember.kernels.cpu_moe import Int4Experts
    from ember.model.checkpoint import PackedInt4
    from ember.model.files import resolve_serving
    from ember.model.loader import load_model
    folder = folders["int4"][0]
    assert resolve_serving(folder) == ("bfloat16", "q4")  # auto: the checkpoint's own codes
    assert resolve_serving(folders["fp8"][0], "float32") == ("float32", "dense")
    loaded = load_model(folder, "bfloat16", "q4")
    moes = [layer.mlp for layer in loaded.model.layers if hasattr(layer.mlp, "fused")]
    assert moes and all(isinstance(m.fused, Int4Experts) for m in moes)
    assert all(m.gate_up.numel() == 0 and m.down.numel() == 0 for m in moes)  # no dense copy kept
    # the kernel computes the checkpoint's codes and scales: the last MoE layer against the reference loop
    # over the stored experts (Int4Linear per expert, the same bits)
    from ember.kernels.cpu_moe import int4_reference, offsets_of
    layer = len(loaded.model.layers) - 1
    stored = Checkpoint(folder).read_all(keep_int4=lambda n: True)
    prefix = f"model.layers.{layer}.mlp.experts."
    experts = [tuple((t.codes.numpy(), t.scale.float().numpy())
                     for t in (stored[f"{prefix}{e}.{p}_proj.weight"] for p in ("gate", "up", "down")))
               for e in range(8)]
    assert isinstance(stored[f"model.layers.{layer}.mlp.experts.0.up_proj.weight"], PackedInt4)
    torch.manual_seed(1)
    counts = torch.tensor([3, 0, 1, 5, 2, 0, 1, 4])
    rows = torch.randn(int(counts.sum()), 64).to(torch.bfloat16)
    out = torch.zeros_like(rows)
    moes[-1].fused(rows, counts, 0, out)
    assert torch.equal(out, int4_reference(rows, offsets_of(counts, 0, 8), experts))
    dense_bytes = sum(m.expert_bytes() for m in load_model(folder, "bfloat16", "dense").model.modules()
                      if hasattr(m, "fused"))
    assert sum(m.expert_bytes() for m in moes) < 0.4 * dense_bytes  # int4 + fp16 scales against bf16


def test_kimi_int4_experts_are_batch_invariant_and_near_the_exact_path(folders, prompts, expected):
    engine = engine_for(folders["int4"][0], dtype="auto", weights="auto")
    assert engine.config.weights == "q4"
    batched = [o.token_ids for o in engine.generate(prompts, greedy())]
    alone = [engine.generate([ids], greedy())[0].token_ids for ids in prompts]
    assert batched == alone
    # int8 activations and bf16 beside the int4 experts, teacher-forced against the exact path (this random
    # model's next-token distributions are flat: the bf16 dequantized model agrees ~92%, this path ~90%)
    from ember.bench.quality import compare_to_reference
    from ember.model.loader import load_model
    folder = folders["int4"][0]
    report = compare_to_reference(load_model(folder, "float32", "dense"), {"q4": engine.loaded}, prompts, 16)["q4"]
    assert report["top1_agreement"] >= 0.8 and report["mean_kl"] < 0.01, report


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_at_tensor_parallel_2_the_same_transformers_tokens(fmt, folders, prompts, expected):
    """Each rank reads its slices of the quantized tensors (dequantized, then sliced: ranks as processes)."""
    engine = engine_for(folders[fmt][0], tensor_parallel=2)
    try:
        outs = engine.generate(prompts[:2], greedy())
    finally:
        engine.close()
    assert [o.token_ids for o in outs] == expected[fmt][:2]


def test_for_cuda_the_int4_experts_are_built_for_the_triton_kernels(folders, prompts):
    """The loader's CUDA branch (no GPU here: built on CPU, whose Int4GroupExperts runs its torch
    fallback; the kernels themselves are checked under the Triton interpreter in
    tests/test_triton_quant_linear.py): the same experts, so the same logits as the C++ int4 path's
    model within bf16 rounding and int8 activations."""
    from ember.kernels.triton_quant_linear import Int4GroupExperts
    from ember.model.loader import load_model
    folder = folders["int4"][0]
    gpu = load_model(folder, "bfloat16", "q4", device="cuda")
    moes = [layer.mlp for layer in gpu.model.layers if hasattr(layer.mlp, "fused")]
    assert moes and all(isinstance(m.fused, Int4GroupExperts) for m in moes)
    assert any(True for _ in moes[0].fused.buffers())  # (a submodule: .to(device) moves it with the model)
    exact = load_model(folder, "float32", "dense")
    from ember.bench.quality import compare_to_reference
    report = compare_to_reference(exact, {"cuda-layout": gpu}, prompts[:2], 8)["cuda-layout"]
    assert report["top1_agreement"] >= 0.8 and report["mean_kl"] < 0.01, report


@pytest.mark.parametrize("fmt", FORMATS)
def test_from_a_cached_prefix_the_same_transformers_tokens(fmt, folders, prompts, expected):
    engine = engine_for(folders[fmt][0])
    ids = prompts[-1]
    engine.generate([ids[:64]], SamplingParams(max_tokens=2, ignore_eos=True))  # caches 4 blocks of it
    [out] = engine.generate([ids], greedy())
    assert out.cached_tokens == 64
    assert out.token_ids == expected[fmt][-1]


def test_q4_by_default_only_where_the_routed_experts_are_stored_int4(folders, tmp_path):
    """A checkpoint whose config declares int4 but whose experts are not stored packed (say, all in the
    ignore list) serves dense by default rather than being refused at start."""
    from ember.model.files import int4_folder, resolve_serving
    assert int4_folder(folders["int4"][0]) and not int4_folder(folders["fp8"][0])
    dense_experts = tmp_path / "int4-config-dense-experts"
    shutil.copytree(folders["int4"][1], dense_experts)  # the dequantized weights, all stored dense
    config = json.loads((folders["int4"][0] / "config.json").read_text())
    config["quantization_config"]["ignore"].append("re:.*experts.*")
    (dense_experts / "config.json").write_text(json.dumps(config))
    assert not int4_folder(dense_experts)
    assert resolve_serving(dense_experts) == ("float32", "dense")
