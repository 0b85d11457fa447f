"""A GGUF's load caches as a model of their own: content-addressed chunks a worker fetches (torch-free).

Before serving a GGUF, a worker whose cache is empty builds its load caches: the HF-layout folder
beside it (ember.model.files.ensure_gguf_cache: the dequantized checkpoint, config, tokenizer; ~12 s
for the shipped SmolLM2 on this host) and, for a Q4_1 file, the int4 kernel's packs in it
(ember.model.q4_cache: ~5 s). A kvstore whose host holds them current publishes them as a folder
manifest (ember.model.weight_chunks) named after the source file's sha256 and the caches' versions
(`derived_name`: the converter's version, the pack layout's version and the kernel's quad width), so
a worker asks for exactly the caches its own code would build from that file. It fetches them like
the model (each chunk checked against its hash, into a temporary folder), `adopt` ties them to its
own copy of the file (the caches are keyed by their source's size and mtime), and the folder is
renamed into place whole: a half-fetched cache is never found. Where no site has them the worker
builds them, as before.
"""
from __future__ import annotations

import json
from pathlib import Path

from ember.model import q4_cache
from ember.model.files import CONVERTER_VERSION, cache_dir_for
from ember.model.weight_chunks import Manifest, build_file_entry

META = "ember.json"


class DerivedCacheError(ValueError):
    """Fetched caches that do not belong to the file they were fetched for."""


def derived_name(gguf_name: str, sha256: str) -> str:
    """The name the load caches of the GGUF `gguf_name` with content `sha256` are published under."""
    return (f"{cache_dir_for(Path(gguf_name)).name}#sha256={sha256}#conv={CONVERTER_VERSION}"
            f"#q4={q4_cache.VERSION}x{q4_cache.QUAD}")


def is_derived_name(name: str) -> bool:
    return "#sha256=" in name


def _current_meta(gguf_path: Path, sha256: str) -> dict | None:
    try:
        meta = json.loads((cache_dir_for(gguf_path) / META).read_text())
        stat = gguf_path.stat()
    except (OSError, ValueError):
        return None
    current = (meta.get("converter_version") == CONVERTER_VERSION and meta.get("fingerprint") == f"sha256:{sha256}"
               and (meta.get("source_size"), meta.get("source_mtime_ns")) == (stat.st_size, stat.st_mtime_ns))
    return meta if current else None


def publishable(gguf_path: str | Path, sha256: str) -> list[str] | None:
    """The files of the GGUF's load caches to publish (relative to its cache folder), when they are there
    and current for the file of content `sha256`; else None. The int4 packs only when current too."""
    gguf_path = Path(gguf_path)
    folder = cache_dir_for(gguf_path)
    if _current_meta(gguf_path, sha256) is None:
        return None
    q4_dir = Path(q4_cache.FILE).parent.name
    rels = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
                  and p.relative_to(folder).parts[0] != q4_dir)
    if q4_cache.cached(gguf_path) is not None:
        rels += sorted((q4_cache.FILE, q4_cache.META))
    return rels


def build_derived_manifest(gguf_path: str | Path, sha256: str) -> Manifest | None:
    """The manifest of the GGUF's current load caches (None when they are not there, or not current)."""
    gguf_path = Path(gguf_path)
    rels = publishable(gguf_path, sha256)
    if rels is None:
        return None
    folder = cache_dir_for(gguf_path)
    manifest = Manifest(derived_name(gguf_path.name, sha256),
                        tuple(build_file_entry(folder / rel, rel) for rel in rels), folder=True)
    if _current_meta(gguf_path, sha256) is None:  # rebuilt while it was read
        return None
    return manifest


def adopt(folder: Path, gguf_path: Path, sha256: str) -> None:
    """Tie fetched caches in `folder` to the local GGUF `gguf_path` (content `sha256`): their metadata must
    name that content and this code's versions; their source size and mtime become the local file's."""
    stat = gguf_path.stat()
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError) as e:
        raise DerivedCacheError(f"fetched load caches hold no readable {META}: {e}") from e
    if meta.get("fingerprint") != f"sha256:{sha256}" or meta.get("converter_version") != CONVERTER_VERSION:
        raise DerivedCacheError(f"fetched load caches were made from {meta.get('fingerprint')} by converter "
                                f"{meta.get('converter_version')}, not from sha256:{sha256} by {CONVERTER_VERSION}")
    meta.update(source_size=stat.st_size, source_mtime_ns=stat.st_mtime_ns)
    (folder / META).write_text(json.dumps(meta))
    q4_meta = folder / q4_cache.META
    if q4_meta.exists():
        packs = json.loads(q4_meta.read_text())
        if (packs.get("version"), packs.get("quad")) != (q4_cache.VERSION, q4_cache.QUAD):
            raise DerivedCacheError(f"fetched int4 packs are layout {packs.get('version')}x{packs.get('quad')}, "
                                    f"this worker's kernel wants {q4_cache.VERSION}x{q4_cache.QUAD}")
        packs.update(source_size=stat.st_size, source_mtime_ns=stat.st_mtime_ns)
        q4_meta.write_text(json.dumps(packs))
