"""Convert a llama-architecture GGUF into a Hugging Face-layout folder (the load cache).

Tensors are dequantized to fp32 (Q4_1, Q8_0, F16, F32, ... via the `gguf` package) and
llama.cpp's Q/K row permutation is undone, so the folder is an ordinary HF checkpoint:
later starts memory-map its safetensors, and transformers can read it too.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ember.model.files import CONVERTER_VERSION, gguf_layer_types
from ember.model.llama import ModelArgs

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_args(reader: GGUFReader) -> ModelArgs:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    def a(key, default=None):
        return _field(reader, f"llama.{key}", default)
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    vocab = a("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelArgs(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")), num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("rope.dimension_count", hidden // heads)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position=int(a("context_length", 2048)), tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection [out, in]."""
    out_dim, in_dim = w.shape
    return w.reshape(num_heads, out_dim // num_heads // 2, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


def read_tensors(reader: GGUFReader, args: ModelArgs) -> dict[str, torch.Tensor]:
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF shapes are innermost-first
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = _unpermute(w, args.num_heads)
            elif parts[2] == "attn_k":
                w = _unpermute(w, args.num_kv_heads)
        else:
            continue  # e.g. rope_freqs: not used by plain Llama
        tensors[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))  # own, writable copy
    return tensors


def build_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict]:
    """A byte-level BPE `tokenizers` object and tokenizer_config from GGUF metadata."""
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") in ("smollm", "starcoder", "qwen2", "llama3"):
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=types[i] == _TOKEN_TYPE_CONTROL, normalized=False)
                for i in range(len(tokens)) if types[i] in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)]
    tok.add_tokens(specials)
    def token_named(key):
        token_id = _field(reader, key)
        return None if token_id is None else tokens[token_id]
    config = {
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": token_named("tokenizer.ggml.bos_token_id"),
        "eos_token": token_named("tokenizer.ggml.eos_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    return tok, config


def convert_gguf(gguf_path: Path, out_dir: Path, fingerprint: str) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ember.json."""
    reader = GGUFReader(str(gguf_path))
    args = read_args(reader)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(read_tensors(reader, args), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok, tok_config = build_tokenizer(reader)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    (tmp / "config.json").write_text(json.dumps(args.to_hf_config(), indent=1))
    (tmp / "ember.json").write_text(json.dumps(
        {"fingerprint": fingerprint, "source": gguf_path.name, "converter_version": CONVERTER_VERSION,
         "layer_types": gguf_layer_types(reader)}))
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)  # atomic: a half-written cache is never picked up
