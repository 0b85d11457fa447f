"""Load a model for serving: a GGUF file (converted once to a cached HF folder) or an HF folder."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ember.model.checkpoint import Checkpoint, MissingTensorError
from ember.model.files import check_weights, ensure_gguf_cache, folder_fingerprint, weights_fingerprint
from ember.model.llama import LlamaModel, ModelArgs
from ember.model.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    args: ModelArgs
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # content hash of the weights; part of every KV block hash
    name: str
    weights_bytes: int  # of the checkpoint in the serving dtype
    weights: str = "dense"  # "dense" (the serving dtype) or "q4" (the GGUF's Q4_1 codes as int4)


def load_model(path: str | Path, dtype: str = "float32", weights: str = "dense", shard=None,
               layers: tuple[int, int] | None = None, device: str = "cpu") -> LoadedModel:
    """The model at `path`. shard: a tensor-parallel rank's part (ember.parallel.shard.RankShard): only
    its slices of each tensor are read, and the model has its local shape. layers: a pipeline stage's
    [first, last) decoder layers (renumbered from 0; the embedding read only where a stage embeds or,
    tied, computes logits). LoadedModel.args stays the whole model's. device: where the model will run
    (a checkpoint's int4 experts are built for its kernels: C++ on CPU, Triton on CUDA)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (run `make setup` to fetch the default model)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    check_weights(path, dtype, weights)
    folder = ensure_gguf_cache(path) if path.suffix == ".gguf" else path
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    checkpoint = Checkpoint(folder)  # sharded files and published quantized formats (ember.model.checkpoint)
    # a checkpoint's own int4 routed experts (Kimi K2.5) stay int4, on the fused MoE kernel
    int4_experts = weights == "q4" and path.suffix != ".gguf"
    if int4_experts and (shard is not None or layers is not None):
        raise ValueError("a checkpoint's int4 experts (weights: q4) are served on one rank for now; "
                         "tensor, expert and pipeline parallelism serve it with weights: dense")
    if args.family != "llama" and weights != "dense" and not (int4_experts and args.moe is not None):
        raise ValueError(f"a {args.family} model is served with weights: dense, or with weights: q4 where its "
                         "checkpoint's routed experts are int4 (int4 serves the Llama family's GGUFs); it runs on "
                         "one rank or tensor, expert or pipeline parallel")
    torch_dtype = DTYPES[dtype]
    packs = _cached_packs(path) if weights == "q4" and shard is None and layers is None else None
    if shard is not None or layers is not None:
        tensors = _read_part(checkpoint, torch_dtype, args, shard, layers)
    else:
        # the embedding is only looked up by row: map it, don't load it (113 MB for SmolLM2);
        # layer linears the packed cache holds are never read; nor a multimodal wrapper's other towers
        embedding = args.weights_prefix + "model.embed_tokens.weight"
        tensors = checkpoint.read_all(torch_dtype, mapped=(embedding,),
                                      skip=_is_layer_linear if packs is not None else _outside(args),
                                      keep_int4=_is_routed_expert if int4_experts else None)
    weights_bytes = sum(t.numel() * t.element_size() for t in tensors.values() if isinstance(t, torch.Tensor))
    local = args if shard is None else shard.local_args(args)
    if layers is not None:
        local = local.for_layers(*layers)
    with _skip_weight_init():
        model = LlamaModel(local)
    if layers is not None:  # a stage without the embedding or the output layer holds zero rows of them
        if tensors.get(args.weights_prefix + "model.embed_tokens.weight", torch.empty(1)).shape[0] == 0:
            model.embed_tokens = nn.Embedding(0, args.hidden_size)
        if model.lm_head is not None and \
                tensors.get(args.weights_prefix + "lm_head.weight", torch.empty(1)).shape[0] == 0:
            model.lm_head = nn.Linear(args.hidden_size, 0, bias=False)
    if packs is not None:
        weights_bytes = _use_packed_int4(model, packs, tensors)
    else:
        if int4_experts:
            weights_bytes += _use_int4_experts(model, args, tensors, checkpoint, device)
        try:
            model.load_hf_state_dict(tensors)
        except MissingTensorError as e:  # named with the stored form it was looked for in
            raise checkpoint.missing(e.name) from None
        model.eval().requires_grad_(False)
        if weights == "q4" and not int4_experts:
            weights_bytes = _use_int4(model, path, args, shard, layers[0] if layers is not None else 0)
    return LoadedModel(args, model, Tokenizer.from_folder(folder),
                       weights_fingerprint(folder_fingerprint(folder), weights), path.stem, weights_bytes, weights)


def read_metadata(path: str | Path, dtype: str = "float32", weights: str = "dense") -> LoadedModel:
    """What load_model gives, less the weights (model=None): shape, tokenizer, fingerprint. For an engine
    whose ranks load their own shards."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path} (run `make setup` to fetch the default model)")
    check_weights(path, dtype, weights)
    folder = ensure_gguf_cache(path) if path.suffix == ".gguf" else path
    args = ModelArgs.from_hf_config(json.loads((folder / "config.json").read_text()))
    return LoadedModel(args, None, Tokenizer.from_folder(folder),
                       weights_fingerprint(folder_fingerprint(folder), weights), path.stem, 0, weights)


def _read_part(checkpoint: Checkpoint, dtype: torch.dtype, args: ModelArgs, shard, layers: tuple[int, int] | None
               ) -> dict[str, torch.Tensor]:
    """A parallel rank's part of the checkpoint's tensors, read through safetensors' slices (only the part is
    copied out of the map). layers: a pipeline stage's [first, last) decoder layers, renumbered from 0,
    the norms, and the embedding where the stage uses it (the first stage looks tokens up; the last
    computes logits, with the embedding when tied; elsewhere an empty one stands in). shard: a
    tensor-parallel rank's part of each tensor (ember.parallel.shard.tensor_part: slices, joined when a
    stacked gate/up gives two), or an expert-parallel rank's experts."""
    from ember.parallel.shard import tensor_part
    first, last = layers if layers is not None else (0, args.num_layers)
    needs_embedding = first == 0 or (last == args.num_layers and args.tie_word_embeddings)
    top = args.weights_prefix  # a multimodal wrapper's text model: only its names, under this prefix
    tensors = {}
    with checkpoint as f:  # safetensors' slice interface over every file, quantized weights dequantized
        for name in f.keys():
            if not name.startswith(top):
                continue  # (the wrapper's vision tower and projector)
            bare, name_here = name[len(top):], name
            if bare.startswith("model.layers."):
                index = int(bare.split(".")[2])
                if not first <= index < last:
                    continue
                name_here = f"{top}model.layers.{index - first}." + bare.split(".", 3)[3]
            elif (bare == "model.embed_tokens.weight" and not needs_embedding) or \
                    (bare == "lm_head.weight" and last != args.num_layers):
                tensors[name] = torch.empty(0, args.hidden_size, dtype=dtype)
                continue
            part = f.get_slice(name)
            if shard is None:
                t = part[:]
            elif hasattr(shard, "experts"):  # expert parallel: only this rank's experts are read
                if not shard.reads(name):
                    continue
                rows = shard.stacked_rows(name)
                t = part[:] if rows is None else part[slice(*rows)]
            else:  # tensor parallel: this rank's pieces (ember.parallel.shard.tensor_part)
                wanted = tensor_part(bare, args, shard)
                if wanted is None:
                    continue  # another rank's expert (expert parallelism inside the group)
                ndim = len(part.get_shape())
                index = [tuple(slice(*span) if span else slice(None) for span in piece[:ndim])
                         for piece in wanted.pieces]
                pieces = [part[i] if i else part[:] for i in index]
                t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=wanted.dim)
            tensors[name_here] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t.contiguous()
    return tensors


# each int4 layer linear and the GGUF tensors stacked into it (fused QKV, gate/up)
Q4_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            "mlp.down_proj": ("mlp.down_proj",)}


def _outside(args: ModelArgs):
    """For a text model under a multimodal wrapper (Llama 4's `language_model.`): whether a tensor is
    not the text model's (the vision tower, the projector: never read). None: every tensor is read."""
    if not args.weights_prefix:
        return None
    return lambda name: not name.startswith(args.weights_prefix)


def _is_routed_expert(name: str) -> bool:
    return ".experts." in name and name.endswith("_proj.weight")


def _use_int4_experts(model: LlamaModel, args: ModelArgs, tensors: dict, checkpoint: Checkpoint,
                      device: str = "cpu") -> int:
    """Give each MoE block its checkpoint's int4 experts, kept int4: on CPU the fused C++ kernel
    (ember.kernels.cpu_moe: the codes and scales as stored, w = scale * (q - 8)), on CUDA the grouped
    Triton kernels (ember.kernels.triton_quant_linear.Int4GroupExperts, moved with the model); returns
    their bytes. The experts' entries are taken out of `tensors`."""
    from ember.model.checkpoint import PackedInt4
    from ember.model.moe import MoE
    if device == "cuda":
        from ember.kernels.triton_quant_linear import Int4GroupExperts

        def use_int4_experts(moe, experts):
            moe.fused = Int4GroupExperts([[PackedInt4(c, s, 32) for c, s in expert] for expert in experts])
            moe.packed = None
            moe.gate_up = nn.Parameter(moe.gate_up.new_empty(0, *moe.gate_up.shape[1:]), requires_grad=False)
            moe.down = nn.Parameter(moe.down.new_empty(0, *moe.down.shape[1:]), requires_grad=False)
    else:
        from ember.kernels.cpu_moe import use_int4_experts
    total = 0
    for i, layer in enumerate(model.layers):
        moe = getattr(layer, "mlp", None)
        if not isinstance(moe, MoE):
            continue
        prefix = f"{args.weights_prefix}model.layers.{i}.{args.mlp_name}.experts."
        experts = []
        for e in range(moe.first, moe.last):
            names = [f"{prefix}{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise checkpoint.missing(missing[0])
            parts = [tensors.pop(n) for n in names]
            if not all(isinstance(t, PackedInt4) for t in parts):
                raise ValueError(f"weights 'q4': expert {e} of layer {i} is not stored as int4 in "
                                 f"{checkpoint.folder.name}; serve the checkpoint with weights: dense")
            experts.append(tuple((t.codes, t.scale) for t in parts))
        use_int4_experts(moe, experts)
        total += moe.expert_bytes()
    return total


def _is_layer_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def _cached_packs(gguf_path: Path) -> dict | None:
    """The GGUF's packed int4 weights from its on-disk cache (ember.model.q4_cache), built there on the
    first start; None where the C++ kernel cannot serve them (the engine packs for torch's then)."""
    if gguf_path.suffix != ".gguf":
        return None
    from ember.model import q4_cache
    cache = q4_cache.ensure(gguf_path)
    return q4_cache.load(cache) if cache is not None else None


def _use_packed_int4(model: LlamaModel, packs: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Install the cached packs as the layers' int4 linears and the output layer's nominating pass, then
    load the rest (norms, embedding) from `tensors`; returns weight bytes. The same modules as
    _use_int4 builds, over memory-mapped weights."""
    from ember.kernels.cpu_int4 import Int4Linear, Int4Logits, decode_layer
    for i, layer in enumerate(model.layers):
        for target in Q4_FUSED:
            parent, attr = target.split(".")
            setattr(getattr(layer, parent), attr, Int4Linear.from_pack(packs[f"model.layers.{i}.{target}"]))
    model.load_hf_state_dict(tensors, linears=False)
    model.eval().requires_grad_(False)
    output = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = Int4Logits(output, pack=packs["logits"])
    model.small_step, model.small_step_rows = decode_layer, sys.maxsize
    return sum(m.weight_bytes for m in model.modules() if isinstance(m, Int4Linear)) + sum(
        p.numel() * p.element_size() for p in model.parameters())


def _use_int4(model: LlamaModel, gguf_path: Path, args: ModelArgs, shard=None, first_layer: int = 0) -> int:
    """Swap every layer linear for an Int4Linear over the GGUF's own Q4_1 codes; returns weight bytes.
    A parallel rank's model: its layers are the file's from `first_layer` on, and each takes its
    shard's slice of the codes (rows of QKV and gate/up, input columns of o_proj and down: whole
    32-weight groups, as heads and 64-column MLP steps are)."""
    from ember.kernels.cpu_int4 import INT4_MAX_ROWS, Int4Linear, Int4Logits, decode_layer, int4_available
    from ember.model.gguf_quant import GROUP, Q4Weight, read_q4_1
    from ember.parallel.shard import tensor_slice
    if not int4_available():
        raise RuntimeError("weights='q4' needs torch's int4 CPU kernels (aten._weight_int4pack_mm_for_cpu) and oneDNN")
    q4 = read_q4_1(gguf_path)

    def part(name: str) -> Q4Weight:
        w = q4.pop(name)
        if shard is None:
            return w
        rows, cols = tensor_slice(name, args, shard)
        if cols and (cols[0] % GROUP or cols[1] % GROUP):
            raise ValueError(f"{name}: tensor_parallel {shard.degree} splits its inputs at {cols}, not on the Q4_1 "
                             f"groups of {GROUP}: use weights: dense for this model at this degree")
        r = slice(*rows) if rows else slice(None)
        c, g = (slice(*cols), slice(cols[0] // GROUP, cols[1] // GROUP)) if cols else (slice(None), slice(None))
        return Q4Weight(np.ascontiguousarray(w.codes[r, c]), np.ascontiguousarray(w.scale[r, g]),
                        np.ascontiguousarray(w.low[r, g]))
    read = 0
    for i, layer in enumerate(model.layers):
        for target, sources in Q4_FUSED.items():
            names = [f"model.layers.{first_layer + i}.{s}.weight" for s in sources]
            missing = [n for n in names if n not in q4]
            if missing:
                raise ValueError(f"{gguf_path.name} has no Q4_1 tensor for {missing[0]}: "
                                 "weights='q4' needs Q4_1 layers")
            w = Q4Weight.concat([part(n) for n in names])
            parent, attr = target.split(".")
            module = getattr(layer, parent)
            linear = Int4Linear(w.codes, w.scale, w.low)
            setattr(module, attr, linear)  # the dense weight is dropped
            read += linear.weight_bytes
    output = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    if output.shape[0]:  # (a pipeline stage without the output layer holds zero rows of it)
        model.lm_head = Int4Logits(output)
    native = any(m.native is not None for m in model.modules() if isinstance(m, Int4Linear))
    model.small_step, model.small_step_rows = decode_layer, sys.maxsize if native else INT4_MAX_ROWS
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    return read + rest


@contextmanager
def _skip_weight_init():
    """Build modules without random init: every weight is overwritten by the checkpoint.

    (Random init of 135M parameters costs ~0.7 s; the meta device costs ~1 s on first use.)
    """
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
