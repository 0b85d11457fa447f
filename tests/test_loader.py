"""Loading: GGUF -> cached HF folder, HF folders, tokenizer and chat template parity."""
from __future__ import annotations

import pytest

from ember.model.files import cache_dir_for
from ember.model.loader import load_model

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
def unoptimized(model_path):
    """A model no engine has touched (engines swap in packed kernels in place)."""
    return load_model(model_path)


def test_hf_folder_loads_with_the_same_weights(model_path, unoptimized):
    import torch
    from_folder = load_model(cache_dir_for(model_path))
    assert from_folder.args == unoptimized.args
    a, b = from_folder.model.state_dict(), unoptimized.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_hf_folder_written_by_transformers_loads(tmp_path, hf_model, unoptimized):
    import torch
    from safetensors.torch import save_file
    tok, model = hf_model
    # transformers will not re-save a GGUF-loaded model, so write the folder the way it would
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(tmp_path / "config.json")
    tok.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.args.num_layers == 30 and ours.args.num_kv_heads == 3 and ours.args.tie_word_embeddings
    assert ours.fingerprint.startswith("sha256:") and ours.fingerprint != unoptimized.fingerprint
    torch.testing.assert_close(ours.model.layers[5].self_attn.qkv_proj.weight,
                               unoptimized.model.layers[5].self_attn.qkv_proj.weight)
    assert ours.tokenizer.encode(TEXTS[0]) == unoptimized.tokenizer.encode(TEXTS[0])


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
