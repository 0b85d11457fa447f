"""Loading: GGUF -> cached HF folder, HF folders, tokenizer and chat template parity."""
from __future__ import annotations

import pytest

from ember.model.files import cache_dir_for
from ember.model.loader import load_model
from tests.conftest import PROMPTS

TEXTS = [
    "Hello world! 12345 don't   stop\n\n  tabs\tand émojis 🎉",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x**2  # 3.14159",
    "日本語のテキストも大丈夫ですか？",
]


def test_gguf_cache_is_an_hf_folder_and_is_reused(model_path, loaded):
    cache = cache_dir_for(model_path)
    weights = cache / "model.safetensors"
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "ember.json"} <= {p.name for p in cache.iterdir()}
    mtime = weights.stat().st_mtime_ns
    again = load_model(model_path)
    assert weights.stat().st_mtime_ns == mtime, "a fresh cache must not be rewritten"
    assert again.fingerprint == loaded.fingerprint and loaded.fingerprint.startswith("sha256:")


@pytest.fixture(scope="module")
def hf_saved_folder(tmp_path_factory, hf_model, model_path):
    """An HF-layout folder that no Ember code writes: transformers' own GGUF dequantization
    (the `hf_model` reference), saved by transformers' `save_pretrained` (model and tokenizer,
    safetensors) into a fresh temporary folder."""
    import copy
    tok, gguf_model = hf_model
    # transformers refuses to save a model it loaded from GGUF ("quantized with gguf and is not
    # serializable"), so copy its dequantized tensors into a plain model of the same config
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    plain = type(gguf_model)(config)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    folder = tmp_path_factory.mktemp("hf_saved")
    plain.save_pretrained(folder)
    tok.save_pretrained(folder)
    assert folder.resolve().is_relative_to(tmp_path_factory.getbasetemp().resolve())
    assert folder.resolve() != cache_dir_for(model_path).resolve()
    assert "ember.json" not in {p.name for p in folder.iterdir()}  # not a folder Ember's converter wrote
    return folder


def _saved_tensors(folder) -> dict:
    from safetensors import safe_open  # the library's reader, not Ember's
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


@pytest.mark.slow
def test_an_hf_folder_saved_by_transformers_loads_its_tensors(hf_saved_folder, hf_model, model_path):
    import torch
    tok, _ = hf_model
    folder = hf_saved_folder
    saved = _saved_tensors(folder)
    lm = load_model(folder)
    assert "ember.json" not in {p.name for p in folder.iterdir()}, "Ember must not convert an HF folder"
    assert lm.args.num_layers == 30 and lm.args.num_kv_heads == 3 and lm.args.tie_word_embeddings
    assert "lm_head.weight" not in saved  # tied: save_pretrained writes the embedding once
    ours = lm.model.state_dict()
    expected = {"embed_tokens.weight": saved["model.embed_tokens.weight"], "norm.weight": saved["model.norm.weight"]}
    for i in range(lm.args.num_layers):
        p = f"model.layers.{i}."
        expected |= {
            f"layers.{i}.input_layernorm.weight": saved[p + "input_layernorm.weight"],
            f"layers.{i}.post_attention_layernorm.weight": saved[p + "post_attention_layernorm.weight"],
            f"layers.{i}.self_attn.qkv_proj.weight": torch.cat([saved[p + f"self_attn.{n}_proj.weight"]
                                                               for n in "qkv"]),
            f"layers.{i}.self_attn.o_proj.weight": saved[p + "self_attn.o_proj.weight"],
            f"layers.{i}.mlp.gate_up_proj.weight": torch.cat([saved[p + "mlp.gate_proj.weight"],
                                                             saved[p + "mlp.up_proj.weight"]]),
            f"layers.{i}.mlp.down_proj.weight": saved[p + "mlp.down_proj.weight"],
        }
    assert sorted(ours) == sorted(expected)
    unequal = [k for k in ours if ours[k].dtype != torch.float32 or not torch.equal(ours[k], expected[k])]
    assert unequal == []
    # Ember's own GGUF conversion dequantizes to what transformers' does (under another fingerprint)
    from_gguf = load_model(model_path)
    assert lm.fingerprint.startswith("sha256:") and lm.fingerprint != from_gguf.fingerprint
    torch.testing.assert_close(from_gguf.model.state_dict()["layers.5.self_attn.qkv_proj.weight"],
                               expected["layers.5.self_attn.qkv_proj.weight"])
    for text in TEXTS:  # the tokenizer (and chat template) save_pretrained wrote
        assert lm.tokenizer.encode(text) == tok.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi"}]
    assert lm.tokenizer.apply_chat_template(messages) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_an_hf_folder_saved_by_transformers_generates_transformers_greedy_tokens(hf_saved_folder):
    import torch
    from transformers import AutoModelForCausalLM

    from ember.engine.config import EngineConfig
    from ember.engine.engine import LLMEngine
    from ember.engine.sampling_params import SamplingParams
    folder = hf_saved_folder
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", weights="dense", num_kv_blocks=128))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the same folder
    cfg, args = reference.config, engine.loaded.args
    theirs = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
              cfg.rope_parameters["rope_theta"], cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.vocab_size)
    assert (args.num_layers, args.num_heads, args.num_kv_heads, args.head_dim, args.rope_theta, args.rms_norm_eps,
            args.max_position, args.vocab_size) == theirs
    chat = engine.tokenizer.apply_chat_template([{"role": "user",
                                                  "content": "Name three planets of the solar system."}])
    max_new = 24
    for prompt in (PROMPTS[1], chat):
        ids = engine.tokenizer.encode(prompt)
        [out] = engine.generate([ids], SamplingParams(max_tokens=max_new))
        with torch.inference_mode():
            greedy = reference.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                        attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out.token_ids == greedy[0, len(ids):].tolist()[:len(out.token_ids)]
        assert len(out.token_ids) == max_new or out.finish_reason == "stop"
    assert "ember.json" not in {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(loaded, hf_model, text):
    tok, _ = hf_model
    ids = loaded.tokenizer.encode(text)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(loaded, hf_model):
    tok, _ = hf_model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert loaded.tokenizer.apply_chat_template(messages) == \
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="role"):
        loaded.tokenizer.apply_chat_template([{"content": "no role"}])


def test_bf16_weights_are_selectable(model_path):
    import torch
    lm = load_model(model_path, dtype="bfloat16")
    assert lm.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model(model_path, dtype="int3")


def test_missing_model_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="make setup"):
        load_model(tmp_path / "nope.gguf")
