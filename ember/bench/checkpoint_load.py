"""Load time and resident memory of a checkpoint in Kimi K2.5's published format (routed experts int4,
compressed-tensors pack-quantized, the rest bf16) served as it is (weights q4: the experts stay int4 on
the fused MoE kernel) against the same weights dequantized to a bf16 checkpoint served dense.

Each load runs in a fresh process (its resident size is the model's, not a previous load's), twice;
the figures are the faster load and its resident set after loading."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# a DeepSeek-V3 structure big enough for the experts to dominate (~90% of the parameters)
FIELDS = dict(vocab_size=49152, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=6,
              intermediate_size=2048, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64, n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
              moe_intermediate_size=512, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
              initializer_range=0.02, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

_CHILD = """
import json, sys, time, gc, psutil, torch
torch.set_num_threads(2)
from ember.model.loader import load_model
start = time.perf_counter()
loaded = load_model(sys.argv[1], sys.argv[2], sys.argv[3])
seconds = time.perf_counter() - start
gc.collect()
print(json.dumps({"load_s": seconds, "rss_mb": psutil.Process().memory_info().rss / 1e6,
                  "weights_mb": loaded.weights_bytes / 1e6}))
"""


def _baseline_rss_mb() -> float:
    """A process that imported the same modules but loaded nothing."""
    out = subprocess.run([sys.executable, "-c", "import json, psutil, torch; import ember.model.loader; "
                          "print(json.dumps(psutil.Process().memory_info().rss / 1e6))"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _load(folder: Path, dtype: str, weights: str, reps: int) -> dict:
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", _CHILD, str(folder), dtype, weights],
                             capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda r: r["load_s"])
    return best | {"load_s_all": [round(r["load_s"], 3) for r in runs]}


def int4_against_bf16(root: Path, tokenizer_folder: Path, reps: int = 2) -> dict:
    from ember.bench.published_formats import write_published
    from ember.bench.random_models import save_random
    dense = save_random("DeepseekV3Config", FIELDS, root / "dense-bf16", tokenizer_folder, dtype="bfloat16")
    int4, bf16 = write_published(dense, root, "int4")
    base = _baseline_rss_mb()
    sizes = {name: sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
             for name, folder in (("int4", int4), ("bf16", bf16))}
    results = {"int4 experts (q4)": _load(int4, "bfloat16", "q4", reps) | {"disk_mb": sizes["int4"]},
               "bf16 dequantized (dense)": _load(bf16, "bfloat16", "dense", reps) | {"disk_mb": sizes["bf16"]}}
    for r in results.values():
        r["model_rss_mb"] = r["rss_mb"] - base
    return {"baseline_rss_mb": base, "shape": {k: FIELDS[k] for k in ("hidden_size", "num_hidden_layers",
                                                                      "n_routed_experts", "moe_intermediate_size")},
            "loads": results, "quality": quality(int4)}


def quality(int4: Path, prompts: int = 4, steps: int = 16) -> dict:
    """Teacher-forced next-token distributions of the int4-experts path (and of the bf16 dequantized model,
    the same weights in bf16) against the exact path (fp32 dequantized): ember.bench.quality."""
    from ember.bench.agentic_workload import SYSTEM  # (a long text to read: the agent bench's system prompt)
    from ember.bench.quality import compare_to_reference
    from ember.model.loader import load_model
    from ember.model.tokenizer import Tokenizer
    ids = Tokenizer.from_folder(int4).encode(SYSTEM)
    cuts = [ids[i * 97 % max(1, len(ids) - 160):][:128] for i in range(prompts)]
    exact = load_model(int4, "float32", "dense")
    candidates = {"int4 experts (q4)": load_model(int4, "bfloat16", "q4"),
                  "bf16 dequantized (dense)": load_model(int4, "bfloat16", "dense")}
    report = compare_to_reference(exact, candidates, cuts, steps)
    return {name: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                   if k != "greedy_match_tokens"} for name, r in report.items()}
