"""Random-weight checkpoints written by transformers itself (`save_pretrained`), in a family's real
structure at a chosen size, with the default model's tokenizer beside them: what the MoE and
family benchmarks (and tests/families.py) load as they would a real checkpoint."""
from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def save_random(config_class: str, fields: dict, folder: Path, tokenizer_folder: Path, seed: int = 0,
                dtype: str = "float32") -> Path:
    """A random checkpoint of transformers' `config_class` with `fields`, saved in `folder` (kept if
    there). Buffers a random init leaves at zero that steer routing (DeepSeek-V3's correction bias)
    get small random values, so they matter."""
    import torch
    import transformers
    if (folder / "config.json").exists():
        return folder
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.05)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, tmp / name)
    tmp.rename(folder)
    return folder
