"""How far a serving mode's next-token distributions are from the fp32 reference.

Teacher-forced: both models read the same tokens (the prompt, then the reference's own
greedy continuation), one decode step at a time, so every position is compared on the
same context and the path under test is the one decode really takes (int4 kernels for
`weights="q4"`). Reported per mode: top-1 agreement, mean KL(ref || mode), max |Δlogit|,
and how many greedy tokens match before the first disagreement.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.model.loader import LoadedModel


class ContiguousAttend:
    """The model's `Attend` over a plain growing K/V list: a reference, not a serving path."""

    def __init__(self, num_layers: int):
        self.keys = [None] * num_layers
        self.values = [None] * num_layers

    def __call__(self, layer_idx, q, k, v):
        if self.keys[layer_idx] is not None:
            k = torch.cat([self.keys[layer_idx], k])
            v = torch.cat([self.values[layer_idx], v])
        self.keys[layer_idx], self.values[layer_idx] = k, v
        start = k.shape[0] - q.shape[0]
        mask = torch.arange(k.shape[0])[None, :] <= (start + torch.arange(q.shape[0]))[:, None]
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True)
        return out[0].transpose(0, 1)


@torch.inference_mode()
def _step_logits(loaded: LoadedModel, prompt: list[int], steps: int,
                 forced: list[int] | None = None) -> tuple[torch.Tensor, list[int]]:
    """Logits [steps, V] after the prompt and after each next token, and those tokens: the
    `forced` ones, or the model's own greedy picks."""
    model = loaded.model
    attend = ContiguousAttend(loaded.args.num_layers)
    hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), attend)
    rows, tokens = [], []
    for i in range(steps):
        rows.append(model.compute_logits(hidden[-1:]).float())
        tokens.append(forced[i] if forced is not None else int(rows[-1].argmax()))
        if i + 1 < steps:
            hidden = model(torch.tensor(tokens[-1:]), torch.tensor([len(prompt) + i]), attend)
    return torch.cat(rows), tokens


@torch.inference_mode()
def compare_to_reference(reference: LoadedModel, candidates: dict[str, LoadedModel], prompts: list[list[int]],
                         new_tokens: int) -> dict[str, dict]:
    totals = {name: {"positions": 0, "top1_agree": 0, "kl_sum": 0.0, "max_abs_logit_diff": 0.0,
                     "greedy_match_tokens": []} for name in candidates}
    for prompt in prompts:
        ref_logits, greedy = _step_logits(reference, prompt, new_tokens)  # the reference's own continuation
        ref_logp = ref_logits.log_softmax(-1)
        for name, loaded in candidates.items():
            logits, _ = _step_logits(loaded, prompt, new_tokens, forced=greedy)
            agree = logits.argmax(-1) == ref_logits.argmax(-1)
            t = totals[name]
            t["positions"] += len(agree)
            t["top1_agree"] += int(agree.sum())
            t["kl_sum"] += float(F.kl_div(logits.log_softmax(-1), ref_logp, log_target=True, reduction="sum"))
            t["max_abs_logit_diff"] = max(t["max_abs_logit_diff"], float((logits - ref_logits).abs().max()))
            misses = (~agree).nonzero()
            t["greedy_match_tokens"].append(int(misses[0]) if len(misses) else len(agree))
    return {name: {"positions": t["positions"], "top1_agreement": t["top1_agree"] / t["positions"],
                   "mean_kl": t["kl_sum"] / t["positions"], "max_abs_logit_diff": t["max_abs_logit_diff"],
                   "greedy_match_tokens": t["greedy_match_tokens"]} for name, t in totals.items()}


QUALITY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 times 3?\nA:",
    "<|im_start|>user\nExplain in two sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nList three uses of a KV cache in LLM serving.<|im_end|>\n<|im_start|>assistant\n",
]


def main(args) -> int:
    """`ember bench quality`: bf16 dense and q4 against the fp32 reference, teacher-forced."""
    import torch

    from ember.bench.measure import progress, write_result
    from ember.kernels import optimize
    from ember.model.loader import load_model
    torch.set_num_threads(args.threads or 2)
    progress("loading fp32 (reference), bf16 and q4")
    models = {}
    for name, dtype, weights in (("fp32", "float32", "dense"), ("bf16", "bfloat16", "dense"),
                                 ("q4", "bfloat16", "q4")):
        models[name] = load_model(args.model, dtype, weights)
        optimize(models[name].model)
    reference = models.pop("fp32")
    prompts = [reference.tokenizer.encode(p) for p in QUALITY_PROMPTS[:2 if args.quick else None]]
    new_tokens = 8 if args.quick else 48
    result = {"model": args.model, "prompts": len(prompts), "new_tokens": new_tokens,
              "modes": compare_to_reference(reference, models, prompts, new_tokens)}
    q4 = result["modes"]["q4"]
    result["targets"] = {"q4 top-1 agreement with fp32": {"value": round(q4["top1_agreement"], 4),
                                                          "mean_kl": round(q4["mean_kl"], 5)}}
    write_result(result, args.output)
    return 0
