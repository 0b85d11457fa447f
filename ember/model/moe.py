"""Mixture-of-experts MLP: a router picks `top_k` experts per token, each expert is a SwiGLU MLP.

Execution groups the step's (token, slot) pairs by expert, so each chosen expert's weights are
read once per step (decode reads the active experts' bytes, not all of them), and combines each
token's slots in its own fixed order (slot 0, 1, ...): a token's output does not depend on which
other tokens share its step, so a request gives the same tokens alone and batched, before and
after a migration. An expert's rows are padded to at least MIN_ROWS (torch's CPU matmul takes
another kernel for fewer rows; ember.engine.attention measured the same fact) unless the experts are
packed for oneDNN (`pack_experts`, on CPU), whose kernel gives a row the same bits at any row count
(checked for 1-63 rows in fp32 and bf16; the dense layers' PackedLinears rely on the same fact).
On CPU one C++ call runs all of a step's active experts instead (ember.kernels.cpu_moe, `run_experts`:
every row computed alone, in fp32, bf16 or int4); the loop stays where it cannot build.

Expert parallelism (ember.parallel.expert_parallel): a rank holds only its `local_experts` and every
token (attention is replicated); it computes the slots routed to its experts, leaves the others
zero, and `reduce_slots` (an all-reduce over the ranks) fills in the rest: each slot is one rank's value
plus zeros, exactly what one rank would have computed, so the combine below gives EP = 1's bits.

Tensor parallelism (ember.parallel.shard.plan_family): a rank holds every expert's share of the width
(and the shared expert's), or, with expert parallelism inside the group, its whole experts; either way
its slots and its shared expert's output are partial sums. It combines them in the same fixed slot
order and `reduce` (an all-reduce, as after a dense MLP's down_proj) sums the ranks' outputs once."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.model.args import ModelArgs

MIN_ROWS = 8
# each router kind's checkpoint names in the block: (router weight, shared expert's prefix)
NAMES = {"softmax": ("gate.weight", "shared_experts."), "sigmoid": ("gate.weight", "shared_experts."),
         "llama4": ("router.weight", "shared_expert.")}


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight), the same bits for a row whatever the row count: on CPU fewer than MIN_ROWS
    rows are padded (for one row torch's fp32 matmul takes a matrix-vector kernel that sums in another
    order, so a token routed alone got other weights than in a batch)."""
    rows = x.shape[0]
    if rows < MIN_ROWS and x.device.type == "cpu":
        return F.linear(F.pad(x, (0, 0, 0, MIN_ROWS - rows)), weight)[:rows]
    return F.linear(x, weight)


def route_softmax(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: softmax over all experts, the top_k largest (renormalised when `norm`)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, num_groups: int, topk_groups: int,
                  norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (noaux_tc): sigmoid scores; the correction bias only steers the choice; experts in
    groups, a group's merit is the sum of its two best biased scores, and only the `topk_groups` best
    groups are candidates; the chosen experts' unbiased scores (renormalised when `norm`) times
    `scaling` weigh them."""
    scores = logits.sigmoid()
    choice = scores + bias
    tokens, num_experts = choice.shape
    if num_groups > 1:
        group_merit = choice.view(tokens, num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        groups = torch.topk(group_merit, topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_merit, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(num_experts // num_groups, dim=1), float("-inf"))
    experts = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def route_llama4(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4: the top_k largest logits, each chosen expert's score the sigmoid of its logit (in fp32,
    rounded to the logits' dtype as transformers does). The score scales the expert's input, not its
    output (MoE.forward)."""
    top, experts = torch.topk(logits, top_k, dim=1)
    return torch.sigmoid(top.float()).to(logits.dtype), experts


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        m = args.moe
        self.spec = m
        self.num_experts, self.top_k, self.intermediate_size = m.num_experts, m.top_k, m.intermediate_size
        self.first, self.last = m.local_experts or (0, m.num_experts)  # the experts this rank holds
        self.reduce_slots = None  # expert parallelism: sums the ranks' slots (set_expert_parallel)
        self.reduce = None  # tensor parallelism: sums the ranks' partial outputs (LlamaModel.set_tensor_parallel)
        self.packed = None  # per local expert (gate_up, down) in a packed layout (pack_experts)
        self.fused = None  # int4 experts for the fused kernel (ember.kernels.cpu_moe.use_int4_experts)
        local = self.last - self.first
        # the sigmoid router scores in fp32 whatever the serving dtype (as its checkpoints are kept)
        # (a plain parameter, not a Linear: the CPU kernels pack Linears, and the router's weight is read as is)
        self.router = nn.Parameter(torch.empty(m.num_experts, args.hidden_size))
        if m.router == "sigmoid":
            self.register_buffer("correction_bias", torch.zeros(m.num_experts))
        # every expert's gate and up rows stacked, [E, 2I, H]; down [E, H, I]
        self.gate_up = nn.Parameter(torch.empty(local, 2 * m.intermediate_size, args.hidden_size))
        self.down = nn.Parameter(torch.empty(local, args.hidden_size, m.intermediate_size))
        self.shared = None
        if m.shared_intermediate_size:
            from ember.model.llama import MLP
            self.shared = MLP(args.hidden_size, m.shared_intermediate_size)
        # tokens routed to each expert since start (ember:moe_expert_tokens_total)
        self.register_buffer("expert_tokens", torch.zeros(m.num_experts, dtype=torch.int64), persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's (weights [T, k] fp32, experts [T, k])."""
        m = self.spec
        if m.router == "sigmoid":
            logits = router_logits(x.float(), self.router.float())
            return route_sigmoid(logits, self.correction_bias.float(), m.top_k, m.num_groups, m.topk_groups,
                                 m.norm_topk_prob, m.scaling_factor)
        if m.router == "llama4":
            weights, experts = route_llama4(router_logits(x, self.router), m.top_k)
            return weights.float(), experts
        weights, experts = route_softmax(router_logits(x, self.router), m.top_k, m.norm_topk_prob)
        return weights.to(x.dtype).float(), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T * k]: token t's slot j at t * k + j
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        rows = x[order // self.top_k]
        scales_input = self.spec.router == "llama4"
        if scales_input:  # Llama 4: each (token, slot) row enters its expert scaled by the slot's score
            rows = rows * weights.flatten()[order].to(x.dtype)[:, None]
        # (another rank's experts leave their slots zero)
        out = torch.zeros_like(rows) if self.last - self.first < self.num_experts else torch.empty_like(rows)
        self.run_experts(rows, counts, out)
        slots = torch.empty_like(out)
        slots[order] = out  # back to (token, slot) order
        if self.reduce_slots is not None:  # every other rank's slots, each one rank's value plus zeros
            slots = self.reduce_slots(slots)
        slots = slots.view(tokens, self.top_k, hidden)
        if not scales_input:
            slots = slots * weights.to(x.dtype)[..., None]
        y = slots[:, 0]
        for j in range(1, self.top_k):  # each token's slots summed in one fixed order
            y = y + slots[:, j]
        if self.shared is not None:
            y = y + self.shared(x)
        return y if self.reduce is None else self.reduce(y)  # (tensor parallel: partial sums, and the shared's)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor, out: torch.Tensor) -> None:
        """out[r] = its expert's MLP of rows[r] (rows grouped by expert, `counts` per expert); the rows of
        experts this rank does not hold are left as they are. One C++ call over the step's active experts
        (ember.kernels.cpu_moe: int4 experts, or the stacked fp32 / bf16 ones) where it runs, else one
        expert at a time."""
        from ember.kernels import cpu_moe
        if self.fused is not None:
            self.fused(rows, counts, self.first, out)
            return
        if self.packed is None and cpu_moe.dense_fits(rows, self.gate_up, self.down):
            cpu_moe.dense_experts(rows, counts, self.first, self.gate_up, self.down, out)
            return
        ends = counts.cumsum(0).tolist()
        for expert in range(self.first, self.last):
            start, end = (ends[expert - 1] if expert else 0), ends[expert]
            if start == end:
                continue
            part = rows[start:end]
            if end - start < MIN_ROWS and self.packed is None:  # (oneDNN's packed kernel needs no padding)
                part = F.pad(part, (0, 0, 0, MIN_ROWS - (end - start)))
            local = expert - self.first
            if self.packed is not None:
                gate_up, down = self.packed[local]
                gate, up = gate_up(part).chunk(2, dim=-1)
                out[start:end] = down(F.silu(gate) * up)[:end - start]
            else:
                gate, up = F.linear(part, self.gate_up[local]).chunk(2, dim=-1)
                out[start:end] = F.linear(F.silu(gate) * up, self.down[local])[:end - start]

    def set_expert_parallel(self, reduce) -> None:
        self.reduce_slots = reduce

    def pack_experts(self, make) -> None:
        """Each local expert's two linears in `make`'s layout (ember.kernels.cpu_linear.PackedLinear:
        oneDNN's blocked weights, ~1.5x F.linear at a decode step's few rows, the same bits); the
        stacked copies are freed. Not where the fused kernel runs them (ember.kernels.cpu_moe), as stacked."""
        from ember.kernels import cpu_moe
        if cpu_moe.weights_fit(self.gate_up, self.down):
            return
        self._expert_bytes = self.expert_bytes()
        self.packed = [(make(self.gate_up[e]), make(self.down[e])) for e in range(self.last - self.first)]
        self.gate_up = nn.Parameter(self.gate_up.new_empty(0, *self.gate_up.shape[1:]), requires_grad=False)
        self.down = nn.Parameter(self.down.new_empty(0, *self.down.shape[1:]), requires_grad=False)

    def expert_bytes(self) -> int:
        """Bytes of the routed experts this module holds (int4, packed or stacked)."""
        if self.fused is not None:
            return self.fused.nbytes
        if self.packed is not None:
            return self._expert_bytes
        return sum(p.numel() * p.element_size() for p in (self.gate_up, self.down))

    def hf_weights(self, take, prefix: str) -> dict[str, torch.Tensor]:
        """This block's tensors from a checkpoint's names (`take(name)` pops one): the router
        (`gate.weight`, DeepSeek's `gate.e_score_correction_bias`, Llama 4's `router.weight`), experts
        stacked (`experts.gate_up_proj` / `experts.down_proj`, as transformers >= 5 saves them; Llama 4's
        the other way round, [E, H, 2I] and [E, I, H], transposed here) or one by one
        (`experts.{e}.gate_proj.weight`, ...), and a shared expert."""
        router, shared = NAMES[self.spec.router]
        own = {"router": take(prefix + router)}
        if self.spec.router == "sigmoid":
            own["correction_bias"] = take(prefix + "gate.e_score_correction_bias")
        stacked = prefix + "experts.gate_up_proj"
        if self.fused is not None:  # int4 experts in place already (ember.kernels.cpu_moe.use_int4_experts)
            own["gate_up"], own["down"] = self.gate_up, self.down
        elif take.has(stacked):
            own["gate_up"], own["down"] = take(stacked), take(prefix + "experts.down_proj")
            whole = stacked_is_whole(own["gate_up"], self.num_experts, self.last - self.first)
            if self.spec.router == "llama4":  # x @ w layout: to the F.linear rows every other family has
                e = slice(self.first, self.last) if whole else slice(None)
                own["gate_up"] = own["gate_up"][e].transpose(1, 2).contiguous()
                own["down"] = own["down"][e].transpose(1, 2).contiguous()
            elif whole:
                own["gate_up"] = own["gate_up"][self.first:self.last].clone()
                own["down"] = own["down"][self.first:self.last].clone()
        else:
            e = range(self.first, self.last)
            own["gate_up"] = torch.stack([torch.cat([take(f"{prefix}experts.{i}.gate_proj.weight"),
                                                     take(f"{prefix}experts.{i}.up_proj.weight")]) for i in e])
            own["down"] = torch.stack([take(f"{prefix}experts.{i}.down_proj.weight") for i in e])
        if self.shared is not None:
            own |= {f"shared.{k}": v for k, v in self.shared.hf_weights(take, prefix + shared).items()}
        return own


def stacked_is_whole(t: torch.Tensor, num_experts: int, local: int) -> bool:
    """A stacked expert tensor read whole (a loader that did not slice it for this rank)."""
    return t.shape[0] == num_experts and local != num_experts


def routed_tokens(model: nn.Module) -> list[int]:
    """Tokens routed to each expert since start, summed over the model's MoE layers ([] if dense)."""
    counts = [m.expert_tokens for m in model.modules() if isinstance(m, MoE)]
    return torch.stack(counts).sum(0).tolist() if counts else []
