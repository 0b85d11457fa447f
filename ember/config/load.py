"""Reading a cluster YAML: validation errors that name the key and the fix, and where each
value came from (the file's line, a default, or the model)."""
from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from ember.config.schema import ClusterConfig

# Keys of the flat layout before the sections; a config that still uses one is told where it went.
MOVED = {"router_http": "router.http", "router_site": "router.site", "prefill_site": "placement.prefill_site",
         "decode_site": "placement.decode_site", "policy": "placement (policy.name is placement.policy)",
         "emulate_links": "placement.emulate_links", "kvstore_capacity_mb": "kvstore.capacity_mb",
         "kvstore_codec": "kvstore.codec", "kvstore_shared_memory": "kvstore.shared_memory",
         "directory_ttl_s": "directory.ttl_s"}


def load_config(path: str | Path) -> ClusterConfig:
    """The validated config of the YAML file `path`; relative paths in it resolve against its folder."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    return config_from_dict(data, path.resolve().parent, str(path))


def config_from_dict(data, base: Path, name: str = "config") -> ClusterConfig:
    if not isinstance(data, dict):
        raise ValueError(f"{name}: a cluster config is a mapping (model, router, sites, ...), "
                         f"got {type(data).__name__}")
    try:
        config = ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{name}: invalid config:\n{explain(e, data)}") from e
    config._base = base
    return config


def explain(error: ValidationError, data: dict | None = None) -> str:
    """One line per problem: where, what was given, what is wrong and what to do."""
    lines = []
    for item in error.errors():
        loc = item["loc"]
        where = ".".join(str(p) for p in loc) or "(top level)"
        given = item.get("input")
        shown = "" if isinstance(given, dict | list) or given is None else f" (got {given!r})"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            key = str(loc[-1])
            if len(loc) == 1 and key in MOVED:
                message = f"unknown key; it moved to `{MOVED[key]}`"
            else:
                known = list(_section_at(loc[:-1]).model_fields) if _section_at(loc[:-1]) else []
                close = difflib.get_close_matches(key, known, n=1)
                message = f"unknown key{f'; did you mean `{close[0]}`?' if close else ''} (known: {', '.join(known)})"
        elif len(loc) == 1 and loc[0] in ("router", "directory") and isinstance(given, str):
            message = (f"now a section: `{loc[0]}: {{{'listen' if loc[0] == 'router' else 'url'}: {given}}}`")
        lines.append(f"  {where}{shown}: {message}")
    return "\n".join(lines)


def _section_at(loc: tuple) -> type[BaseModel] | None:
    """The section class at a validation-error location (None when it is not a section)."""
    model: type[BaseModel] | None = ClusterConfig
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue  # a list index: the element type was taken already
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _model_in(field.annotation)
    return model


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) in (typing.Union, list, dict):
        for arg in reversed(typing.get_args(annotation)):  # dict[str, X]: X; list[X]: X; X | None: X
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def key_lines(path: str | Path) -> dict[tuple, int]:
    """Line (1-based) of every key in the YAML file, by its path: ("engine", "threads"), ("sites", 0, "name")."""
    lines: dict[tuple, int] = {}

    def walk(node, prefix: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                lines[prefix + (key.value,)] = key.start_mark.line + 1
                walk(value, prefix + (key.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[prefix + (i,)] = item.start_mark.line + 1
                walk(item, prefix + (i,))
    root = yaml.compose(Path(path).read_text())
    if root is not None:
        walk(root, ())
    return lines
