"""`ember config check`: the effective config, one line per setting, with where its value came
from: the file (and line), the schema's default, another setting, or the model."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ember.config.load import key_lines
from ember.config.schema import ENGINE_ROLES, ROLE_SETTINGS, ClusterConfig
from ember.model.fetch import MODELS

# Values the schema fills from other settings when the file leaves them unset.
FILLED_FROM = {("router", "site"): "placement.decode_site (else the first site)",
               ("placement", "policy"): "fixed: no regions configured",
               ("placement", "prefill_site"): "the only site with the prefill role",
               ("placement", "decode_site"): "the only site with the decode role",
               ("roles",): "the roles that have an address"}


def effective(config: ClusterConfig, path: str | Path) -> list[tuple[str, str, str]]:
    """(key, value, source) for every setting of `config`, loaded from `path`."""
    lines = key_lines(path)
    name = Path(path).name
    rows: list[tuple[str, str, str]] = []

    def source(keys: tuple) -> str:
        if keys in lines:
            return f"{name}:{lines[keys]}"
        for tail, why in FILLED_FROM.items():
            if keys[-len(tail):] == tail:
                return f"from {why}"
        return "default"

    def walk(value, keys: tuple) -> None:
        if isinstance(value, BaseModel):
            for field in type(value).model_fields:
                walk(getattr(value, field), keys + (field,))
        elif isinstance(value, list) and value and isinstance(value[0], BaseModel):
            for i, item in enumerate(value):
                walk(item, keys + (i,))
        elif isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            for k, item in value.items():
                walk(item, keys + (k,))
        else:
            rows.append((".".join(str(k) for k in keys), _show(value), source(keys)))
    walk(config, ())
    for i, (key, value, src) in enumerate(rows):
        if key.startswith("hardware.default.") and src == "default":
            rows[i] = (key, value, "built-in CPU profile")
    rows.insert(1, ("model (resolved)", str(config.model_path()),
                    "named model: the user cache" if config.model in MODELS else "relative to the config file"))
    rows += _derived(config)
    for role in ENGINE_ROLES:
        if any(s.has(role) for s in config.sites):
            per_role = config.engine.for_role(role)
            for field in ROLE_SETTINGS:
                if getattr(getattr(config.engine, role), field) is not None:
                    rows.append((f"{role} engine: {field}", _show(getattr(per_role, field)), f"engine.{role}.{field}"))
    return rows


def _derived(config: ClusterConfig) -> list[tuple[str, str, str]]:
    from ember.config.derived import model_facts
    try:
        facts = model_facts(config)
    except (FileNotFoundError, ValueError) as e:
        return [("derived.*", "-", f"not derived: {e}")]
    layout = facts.kv_layout
    planes = "K,V" if layout.planes == 2 else "latent"
    values = layout.planes * layout.num_layers * layout.num_kv_heads * layout.head_dim
    per_token = (f"{layout.num_layers} layers x {layout.num_kv_heads} KV heads x {layout.head_dim} x {planes} x "
                 f"{layout.bytes_per_token // values} B ({facts.dtype})")
    rows = [("derived.dtype", facts.dtype, "engine.dtype, resolved against the model file"),
            ("derived.weights", facts.weights, "engine.weights, resolved against the model file"),
            ("derived.kv_bytes_per_token", str(layout.bytes_per_token), per_token),
            ("derived.kv_block_bytes", str(layout.block_bytes), "kv_bytes_per_token x engine.block_size"),
            ("derived.max_model_len", str(facts.max_model_len), "engine.max_model_len, capped by the model"),
            ("derived.model_id", facts.model_id, "the model's folder name")]
    if config.placement.kv_bytes_per_token:
        rows.append(("derived.placement prices links at", f"{config.placement.kv_bytes_per_token} B/token",
                     "placement.kv_bytes_per_token (set: overrides the model's)"))
    return rows


def _show(value) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def render(config: ClusterConfig, path: str | Path) -> str:
    rows = effective(config, path)
    width = max(len(k) for k, _, _ in rows)
    vwidth = min(48, max(len(v) for _, v, _ in rows))
    return "\n".join(f"{k.ljust(width)}  {v.ljust(vwidth)}  # {s}" for k, v, s in rows)
