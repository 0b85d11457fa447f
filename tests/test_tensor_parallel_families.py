"""Tensor parallelism for the latent-attention and mixture-of-experts families (DeepSeek-V3 / Kimi K2.5,
Qwen3-MoE, Llama 4): the shard maths, each rank's part of a checkpoint, then real ranks (spawned
processes, gloo) on the exact fp32 path of random checkpoints built by transformers (tests/families.py):
TP = 2, TP = 2 with expert parallelism inside the group, and TP = 2 x PP = 2 give TP = 1's (and
transformers') greedy tokens; the latent cache is whole on every rank, so blocks cross between
engines of different degrees."""
from __future__ import annotations

import pytest
import torch

from ember.engine.config import EngineConfig
from ember.engine.engine import LLMEngine
from ember.engine.sampling_params import SamplingParams
from ember.model.args import read_model_args
from ember.parallel.shard import plan, tensor_part
from tests.conftest import PROMPTS
from tests.families import build

pytestmark = pytest.mark.timeout(300)
KINDS = ("deepseek_v3", "qwen3_moe", "llama4")
STEPS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_path):
    from ember.model.files import model_folder
    root = tmp_path_factory.mktemp("tp-families")
    return {kind: build(kind, root / kind, model_folder(str(model_path))) for kind in KINDS}


def engine(folder, **overrides) -> LLMEngine:
    config = dict(model=str(folder), dtype="float32", weights="dense", threads=2, kv_cache_mb=32) | overrides
    return LLMEngine(EngineConfig(**config))


def greedy(eng: LLMEngine, ids: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(ids, SamplingParams(max_tokens=steps, ignore_eos=True))]


@pytest.fixture(scope="module")
def references(checkpoints):
    """kind -> (prompts' ids, TP = 1's greedy tokens), TP = 1's first prompt checked against transformers."""
    from transformers import AutoModelForCausalLM
    out = {}
    for kind, folder in checkpoints.items():
        one = engine(folder)
        ids = [one.tokenizer.encode(p) for p in PROMPTS[:4]]
        want = greedy(one, ids)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids[0]]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                              attention_mask=torch.ones(1, len(ids[0]), dtype=torch.long))
        assert want[0] == ref[0, len(ids[0]):].tolist(), kind
        out[kind] = ids, want
    return out


# -- shard maths ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("degree", [2, 3, 4])
def test_every_head_column_expert_and_vocab_row_is_owned_once(kind, degree, checkpoints):
    args = read_model_args(checkpoints[kind])
    if args.mla is None and degree > args.num_kv_heads and degree % args.num_kv_heads:
        with pytest.raises(ValueError, match=f"tensor_parallel {degree} does not split"):
            plan(args, degree)
        return
    for ep in (1, degree):
        shards = plan(args, degree, expert_parallel=ep)
        assert [h for s in shards for h in range(*s.q_heads)] == list(range(args.num_heads))
        if args.mla is not None:  # the latent cache's one "head": whole on every rank
            assert all(s.kv_heads == (0, 1) for s in shards)
        widths = [("columns", args.intermediate_size), ("vocab", args.vocab_size)]
        if ep == 1:
            widths.append(("expert_columns", args.moe.intermediate_size))
            assert all(s.local_experts is None for s in shards)
        else:  # whole experts spread over the ranks
            assert all(s.expert_columns == (0, args.moe.intermediate_size) for s in shards)
            widths.append(("local_experts", args.moe.num_experts))
        if args.moe.shared_intermediate_size:
            widths.append(("shared_columns", args.moe.shared_intermediate_size))
        for field, total in widths:
            spans = [getattr(s, field) for s in shards]
            assert spans[0][0] == 0 and spans[-1][1] == total and all(a < b for a, b in spans), (field, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (field, spans)


def test_a_degree_or_expert_layout_that_cannot_split_the_model_is_refused(checkpoints):
    args = read_model_args(checkpoints["deepseek_v3"])  # 4 heads, 8 experts
    with pytest.raises(ValueError, match="exceeds the model's 4 attention heads"):
        plan(args, 5)
    with pytest.raises(ValueError, match="expert_parallel must be 1 or 2"):
        plan(args, 2, expert_parallel=4)
    for layout in (dict(tensor_parallel=2, expert_parallel=4),
                   dict(tensor_parallel=2, expert_parallel=2, pipeline_parallel=2)):
        with pytest.raises(ValueError, match="must equal tensor_parallel, without pipeline_parallel"):
            engine(checkpoints["qwen3_moe"], **layout)


def test_the_stacked_gate_up_part_is_the_ranks_gate_columns_and_up_columns():
    """transformers >= 5 stacks gate then up along one axis: a rank's width is two pieces of it."""
    from ember.model.args import ModelArgs, MoEArgs
    from ember.parallel.shard import RankShard
    moe = MoEArgs(num_experts=4, top_k=1, intermediate_size=32, layers=(True,), router="softmax")
    args = ModelArgs(vocab_size=8, hidden_size=16, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_position=64, moe=moe)
    shard = RankShard(1, 2, (1, 2), (1, 2), (32, 64), (4, 8), expert_columns=(16, 32))
    part = tensor_part("model.layers.0.mlp.experts.gate_up_proj", args, shard)
    assert part.dim == 1 and part.pieces == ((None, (16, 32)), (None, (48, 64)))
    assert tensor_part("model.layers.0.mlp.experts.down_proj", args, shard).pieces == ((None, None, (16, 32)),)
    assert tensor_part("model.layers.0.mlp.experts.3.up_proj.weight", args, shard).pieces == (((16, 32),),)
    llama4 = ModelArgs(**{**args.__dict__, "moe": MoEArgs(**{**moe.__dict__, "router": "llama4"}),
                          "mlp_name": "feed_forward"})
    part = tensor_part("model.layers.0.feed_forward.experts.gate_up_proj", llama4, shard)  # [E, H, 2I]
    assert part.dim == 2 and part.pieces == ((None, None, (16, 32)), (None, None, (48, 64)))
    inside = RankShard(1, 2, (1, 2), (1, 2), (32, 64), (4, 8), expert_columns=(0, 32), local_experts=(2, 4))
    assert tensor_part("model.layers.0.mlp.experts.1.gate_proj.weight", args, inside) is None  # rank 0's expert
    assert tensor_part("model.layers.0.mlp.experts.gate_up_proj", args, inside).pieces == (((2, 4),),)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_the_ranks_parts_put_back_together_are_the_whole_model(kind, expert_parallel, checkpoints):
    """Each rank reads only its slices of the checkpoint; concatenated over the ranks (replicated
    tensors: equal on every rank) they are the unsplit model's weights, as TP = 1 loads them."""
    from ember.model.loader import load_model
    folder = checkpoints[kind]
    args = read_model_args(folder)
    whole = load_model(folder, "float32").model.state_dict()
    shards = plan(args, 2, expert_parallel=expert_parallel)
    parts = [load_model(folder, "float32", shard=s).model.state_dict() for s in shards]
    for name, w in whole.items():
        got = [p[name] for p in parts]
        if all(g.shape == w.shape for g in got):
            assert all(torch.equal(g, w) for g in got), name  # replicated (norms, routers, the latent's projections)
            continue
        split_width = w.dim() == 2 or got[0].shape[0] == w.shape[0]  # (not whole experts spread over the ranks)
        if name.endswith(("gate_up", "gate_up_proj.weight", "qkv_proj.weight")) and split_width:
            # fused at load: each rank's rows are its gate and up rows (its q, k and v rows), joined piece by piece
            axis = w.dim() - 2
            if name.endswith("qkv_proj.weight"):
                d = args.head_dim
                sizes = [[(s.q_heads[1] - s.q_heads[0]) * d] + [(s.kv_heads[1] - s.kv_heads[0]) * d] * 2
                         for s in shards]
            else:
                sizes = [[g.shape[axis] // 2] * 2 for g in got]
            pieces = list(zip(*(g.split(n, dim=axis) for g, n in zip(got, sizes))))
            got = [torch.cat([torch.cat(p, dim=axis) for p in pieces], dim=axis)]
        else:
            axis = next(d for d in range(w.dim()) if got[0].shape[d] != w.shape[d])
            got = [torch.cat(got, dim=axis)]
        assert torch.equal(got[0], w), name


# -- real ranks -------------------------------------------------------------------------------
LAYOUTS = {"tp2": dict(tensor_parallel=2), "tp2-ep2": dict(tensor_parallel=2, expert_parallel=2),
           "tp2-pp2": dict(tensor_parallel=2, pipeline_parallel=2)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_tensor_parallel_greedy_tokens_equal_tp1_and_transformers(kind, layout, checkpoints, references):
    """fp32: TP = 2 (every expert split by width), TP = 2 with the experts whole over the two ranks,
    and TP = 2 x PP = 2 give TP = 1's tokens, which are transformers' (the `references` fixture). At
    TP x PP the latent blocks gathered from every stage take a TP = 1 engine on to TP = 1's tokens."""
    ids, want = references[kind]
    split = engine(checkpoints[kind], **LAYOUTS[layout])
    try:
        name = split.kernels[-1]
        assert name.startswith("tensor-parallel-2") and ("expert-parallel-2" in name) == ("ep2" in layout)
        assert greedy(split, ids) == want
        if layout != "tp2-pp2":
            assert split.runner.me.loaded.model.layers[-1].self_attn.num_heads == 2  # this rank's 2 of the 4
            # the rank holding each expert, as ember:moe_expert_tokens_total{expert,rank} labels it
            assert split.expert_ranks == ((0,) * 4 + (1,) * 4 if "ep2" in layout else (0,) * 8)
        elif kind == "deepseek_v3":  # each stage's latent layers, gathered whole: TP = 1 continues from them
            [split_long] = greedy(split, [ids[1] + ids[2] + ids[3]])
            exported = _exported(split, ids[1] + ids[2] + ids[3])
    finally:
        split.close()
    if layout == "tp2-pp2" and kind == "deepseek_v3":
        prompt = ids[1] + ids[2] + ids[3]
        [alone] = greedy(engine(checkpoints[kind]), [prompt])
        assert split_long == alone
        one = engine(checkpoints[kind])
        assert one.import_blocks(prompt, *exported) == len(exported[0]) >= 2
        [got] = one.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))
        assert got.cached_tokens == len(exported[0]) * one.config.block_size and got.token_ids == alone


def _exported(eng: LLMEngine, prompt: list[int]) -> tuple[list[bytes], list[bytes]]:
    """(hashes, payloads) of the prompt's full blocks before its last token, as `eng` exports them."""
    from ember.kv import wire
    from ember.kv.block_hash import chain_hashes
    bs = eng.config.block_size
    hashes = chain_hashes(prompt[:(len(prompt) - 1) // bs * bs], bs, eng.block_manager.root_hash)
    return hashes, [bytes(wire.decode_frame(f, eng.frame_template)) for f in eng.export_frames(hashes)]


@pytest.fixture(scope="module")
def latent_tp2(checkpoints):
    eng = engine(checkpoints["deepseek_v3"], tensor_parallel=2)
    yield eng
    eng.close()


def test_latent_blocks_are_whole_on_every_rank_and_cross_between_tp2_and_tp1(checkpoints, references, latent_tp2):
    """The latent cache is not split: both TP = 2 ranks hold every block whole, byte for byte the
    same; a block's frame has TP = 1's header and length (nothing names the layout), its first layer's
    latent is TP = 1's bytes and the later layers' within fp32 rounding (the attention's and experts'
    partial sums are added across ranks in another order); TP = 1 decodes from TP = 2's prefill
    blocks to TP = 1's tokens, and TP = 2 from TP = 1's."""
    import dataclasses

    from ember.kv import wire
    from ember.kv.block_hash import chain_hashes
    ids, _ = references["deepseek_v3"]
    prompt = ids[1] + ids[2] + ids[3]
    one = engine(checkpoints["deepseek_v3"])
    [want] = greedy(one, [prompt])
    bs = one.config.block_size
    # (full blocks before the last token, which is always computed)
    hashes = chain_hashes(prompt[:(len(prompt) - 1) // bs * bs], bs, one.block_manager.root_hash)
    assert len(hashes) >= 2
    two = latent_tp2
    assert two.block_manager.root_hash == one.block_manager.root_hash
    # every rank holds the whole cache: on one host the pool is split between the copies
    assert two.block_manager.num_blocks == one.block_manager.num_blocks // 2
    assert greedy(two, [prompt]) == [want]
    runner = two.runner
    block_ids = [two.block_manager.cached[h] for h in hashes]
    frames2, frames1 = two.export_frames(hashes), one.export_frames(hashes)
    layout = one.layout
    for f2, f1 in zip(frames2, frames1):
        h2, h1 = (dataclasses.asdict(wire.parse_header(f)) for f in (f2, f1))
        assert h2.pop("checksum") and h1.pop("checksum")
        assert h2 == h1 and len(f2) == len(f1)
        k2, k1 = (torch.frombuffer(bytearray(wire.decode_frame(f, one.frame_template)), dtype=torch.float32)
                  .view(layout.num_layers, -1) for f in (f2, f1))
        assert torch.equal(k2[0], k1[0])
        torch.testing.assert_close(k2, k1, rtol=1e-5, atol=1e-5)
    # each rank's own copy of the blocks (gathered as a split cache's heads would be): the same bytes on both
    with runner.group.failing():
        runner.group.send("export", block_ids, 1)
        copies = runner.me.export(block_ids, 1)
    assert len(copies) == 2 and copies[0].shape[:5] == (layout.num_layers, 1, len(block_ids), bs, 1)
    assert torch.equal(copies[0].view(torch.int32), copies[1].view(torch.int32))
    # TP = 2's prefill blocks -> TP = 1 decode, and TP = 1's -> TP = 2
    payloads2 = [bytes(wire.decode_frame(f, one.frame_template)) for f in frames2]
    payloads1 = [bytes(wire.decode_frame(f, one.frame_template)) for f in frames1]
    decode1 = engine(checkpoints["deepseek_v3"])
    assert decode1.import_blocks(prompt, hashes, payloads2) == len(hashes)
    [got] = decode1.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert got.cached_tokens == len(hashes) * bs and got.token_ids == want
    fresh = ids[2] + ids[0] + ids[3]  # a prompt TP = 2 has not seen
    [fresh_want] = greedy(one, [fresh])
    fresh_hashes = chain_hashes(fresh[:(len(fresh) - 1) // bs * bs], bs, one.block_manager.root_hash)
    payloads1 = [bytes(wire.decode_frame(f, one.frame_template)) for f in one.export_frames(fresh_hashes)]
    assert two.import_blocks(fresh, fresh_hashes, payloads1) == len(fresh_hashes)
    [got] = two.generate([fresh], SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert got.cached_tokens == len(fresh_hashes) * bs and got.token_ids == fresh_want


def test_a_request_gives_its_tokens_alone_and_batched_under_tensor_parallel(references, latent_tp2):
    """Each token's slots are combined in one fixed order and the ranks' sums added per row: a
    request's tokens do not depend on the others in its steps."""
    ids, want = references["deepseek_v3"]
    among = latent_tp2.generate([ids[0], *[p[:20 + 7 * i] for i, p in enumerate(ids[1:] * 2)]],
                                SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    assert among.token_ids == want[0]
