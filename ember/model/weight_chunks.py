"""A model as a manifest of content-addressed chunks (torch-free): what kvstores store and move.

A model file (a GGUF, a safetensors file) is cut into chunks of a few MiB whose boundaries follow its
tensors, so that each chunk holds one kind of bytes (`bf16`, `f16`, `f32`, `q4_1`, `q8_0`, ... or
`meta`: headers, metadata, anything else): the lossless codecs of ember.model.weight_codec work per
kind. An HF folder is its files, each cut the same way (safetensors by tensor, the rest as `meta`).

Each chunk: the sha256 of its raw bytes, its offset and length in its file, its kind. The manifest
lists the files (relative path, size, sha256) and their chunks; it is content-addressed: its id is the
sha256 of its canonical JSON, so the id names the model version, and a manifest whose bytes do not hash
to its id is refused. How a store compresses a chunk is not part of the manifest (two stores may hold
the same model raw and compressed; its id is the same): the codec travels with the chunk's bytes.
Reassembly is bit-exact: every chunk is checked against its hash, then the whole file against its sha256.
"""
from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "ember-weights/1"
CHUNK_BYTES = 4 * 2**20
HASH_BYTES = 32  # sha256

# GGUF tensor types: (kind, block elements, block bytes); others are `other`, sized by their neighbours
GGML_TYPES = {0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 8: ("q8_0", 32, 34),
              30: ("bf16", 1, 2)}
SAFETENSORS_KINDS = {"BF16": ("bf16", 2), "F16": ("f16", 2), "F32": ("f32", 4)}
UNIT = {"bf16": 2, "f16": 2, "f32": 4, "q4_0": 18, "q4_1": 20, "q8_0": 34}


class ManifestError(ValueError):
    """A manifest that is malformed or does not hash to its id."""


@dataclass(frozen=True)
class Chunk:
    hash: str     # sha256 of the raw bytes, hex
    offset: int   # in its file
    length: int
    kind: str


@dataclass(frozen=True)
class FileEntry:
    path: str     # relative to the model (a single file: its own name)
    size: int
    sha256: str
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Manifest:
    name: str     # the model file's (or folder's) name, how workers ask for it
    files: tuple[FileEntry, ...]
    folder: bool = False  # an HF folder (files inside `name`) rather than one file

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "name": self.name, "folder": self.folder,
                "files": [{**asdict(f), "chunks": [asdict(c) for c in f.chunks]} for f in self.files]}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property
    def id(self) -> str:  # (computed once: stores look models up by it per chunk)
        return hashlib.sha256(self.to_json()).hexdigest()

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def chunks(self) -> list[tuple[FileEntry, Chunk]]:
        return [(f, c) for f in self.files for c in f.chunks]

    @staticmethod
    def from_json(data: bytes, expect_id: str | None = None) -> Manifest:
        """Parse; ManifestError if malformed, or if it does not hash to `expect_id`."""
        if expect_id is not None and hashlib.sha256(data).hexdigest() != expect_id:
            raise ManifestError(f"manifest bytes do not hash to {expect_id}")
        try:
            body = json.loads(data)
            if body.get("format") != FORMAT:
                raise ManifestError(f"not an {FORMAT} manifest: format {body.get('format')!r}")
            files = tuple(FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"]),
                                    tuple(Chunk(str(c["hash"]), int(c["offset"]), int(c["length"]), str(c["kind"]))
                                          for c in f["chunks"])) for f in body["files"])
            manifest = Manifest(str(body["name"]), files, bool(body.get("folder", False)))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ManifestError):
                raise
            raise ManifestError(f"malformed manifest: {e}") from e
        for f in manifest.files:
            _check_path(f.path)
            end = 0
            for c in f.chunks:
                if c.offset != end or c.length <= 0 or len(bytes.fromhex(c.hash)) != HASH_BYTES:
                    raise ManifestError(f"{f.path}: chunks do not tile the file at offset {c.offset}")
                end += c.length
            if end != f.size:
                raise ManifestError(f"{f.path}: chunks cover {end} bytes of {f.size}")
        if manifest.to_json() != data and expect_id is not None:
            raise ManifestError("manifest is not in canonical form")
        return manifest


def _check_path(path: str) -> None:
    p = Path(path)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise ManifestError(f"file path {path!r} leaves the model")


def chunk_hash(data) -> str:
    return hashlib.sha256(data).hexdigest()


# --- layouts: (start, end, kind) regions tiling a file ----------------------------------------------

def file_regions(path: Path) -> list[tuple[int, int, str]]:
    """Byte regions of one kind each, tiling the file: tensors by kind, everything else `meta`."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(8)
    try:
        if magic[:4] == b"GGUF":
            tensors, data_start = _gguf_tensors(path)
        elif path.suffix == ".safetensors":
            tensors, data_start = _safetensors_tensors(path)
        else:
            return [(0, size, "meta")] if size else []
    except (struct.error, ValueError, KeyError, UnicodeDecodeError):
        return [(0, size, "meta")] if size else []  # not what its name says: one kind of bytes
    return _tile(tensors, data_start, size)


def _tile(tensors: list[tuple[int, int, str]], data_start: int, size: int) -> list[tuple[int, int, str]]:
    regions = [(0, data_start, "meta")] if data_start else []
    pos = data_start
    for start, end, kind in sorted(tensors):
        start, end = max(start, pos), min(end, size)
        if end <= start:
            continue
        if start > pos:  # alignment padding: the tail of the region before it
            regions[-1] = (regions[-1][0], start, regions[-1][2])
        regions.append((start, end, kind))
        pos = end
    if pos < size:
        if regions:
            regions[-1] = (regions[-1][0], size, regions[-1][2])
        else:
            regions.append((0, size, "meta"))
    return regions


def _gguf_tensors(path: Path) -> tuple[list[tuple[int, int, str]], int]:
    """GGUF v2/v3 tensor infos: [(absolute start, end, kind)], and where tensor data starts."""
    with open(path, "rb") as f:
        head = f.read(24)
        _, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        reader = _Reader(f)
        alignment = 32
        for _ in range(n_kv):
            key = reader.string()
            value_type = reader.u32()
            value = reader.value(value_type)
            if key == "general.alignment":
                alignment = int(value)
        infos = []
        for _ in range(n_tensors):
            reader.string()
            dims = [reader.u64() for _ in range(reader.u32())]
            ggml_type = reader.u32()
            infos.append((reader.u64(), ggml_type, dims))  # (offset, type, dims)
        data_start = -(-reader.pos // alignment) * alignment
    size = path.stat().st_size
    infos.sort()
    tensors = []
    for i, (offset, ggml_type, dims) in enumerate(infos):
        start = data_start + offset
        known = GGML_TYPES.get(ggml_type)
        count = 1
        for d in dims:
            count *= d
        if known is not None:
            kind, elements, nbytes = known
            end = start + count // elements * nbytes
        else:
            kind, end = "other", data_start + infos[i + 1][0] if i + 1 < len(infos) else size
        tensors.append((start, end, kind))
    return tensors, data_start


class _Reader:
    """Just enough of GGUF's metadata encoding to skip over it."""
    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                12: "<d"}

    def __init__(self, f):
        self.f, self.pos = f, 24

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError("GGUF header is truncated")
        self.pos += n
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> str:
        return self.read(self.u64()).decode("utf-8", "replace")

    def value(self, value_type: int):
        if value_type in self._SCALARS:
            fmt = self._SCALARS[value_type]
            return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]
        if value_type == 8:
            return self.string()
        if value_type == 9:
            item_type, n = self.u32(), self.u64()
            if item_type in self._SCALARS:  # skipped whole
                self.read(n * struct.calcsize(self._SCALARS[item_type]))
                return None
            for _ in range(n):
                self.value(item_type)
            return None
        raise ValueError(f"unknown GGUF value type {value_type}")


def _safetensors_tensors(path: Path) -> tuple[list[tuple[int, int, str]], int]:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        kind = SAFETENSORS_KINDS.get(info["dtype"], ("other", 1))[0]
        tensors.append((data_start + begin, data_start + end, kind))
    return tensors, data_start


# --- chunking -------------------------------------------------------------------------------------

def chunk_ranges(regions: list[tuple[int, int, str]], target: int = CHUNK_BYTES) -> list[tuple[int, int, str]]:
    """Chunks of at most ~`target` bytes, each of one kind: consecutive regions of a kind merge while
    the chunk stays a whole number of its elements or blocks (padding would shift the blocks after
    it); a region bigger than `target` is cut at element or block boundaries."""
    out: list[list] = []
    for start, end, kind in regions:
        unit = UNIT.get(kind, 1)
        step = max(unit, target // unit * unit)
        pos = start
        if out and out[-1][2] == kind and (out[-1][1] - out[-1][0]) % unit == 0 \
                and out[-1][1] == start and out[-1][1] - out[-1][0] + (end - start) <= target:
            out[-1][1] = end
            continue
        while end - pos > step + step // 4:  # (no sliver of a last piece: the last one takes up to 1.25x)
            out.append([pos, pos + step, kind])
            pos += step
        out.append([pos, end, kind])
    return [tuple(c) for c in out]


def build_file_entry(path: Path, rel: str, target: int = CHUNK_BYTES, on_chunk=None) -> FileEntry:
    """Hash `path` chunk by chunk (and as a whole); `on_chunk(chunk, data)` sees every chunk's bytes
    (a store seeding itself encodes and files them there, in the same read)."""
    whole = hashlib.sha256()
    chunks = []
    with open(path, "rb") as f:
        for start, end, kind in chunk_ranges(file_regions(path), target):
            f.seek(start)
            data = f.read(end - start)
            if len(data) != end - start:
                raise OSError(f"{path} changed while it was read")
            whole.update(data)
            chunk = Chunk(chunk_hash(data), start, end - start, kind)
            chunks.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk, data)
    return FileEntry(rel, path.stat().st_size, whole.hexdigest(), tuple(chunks))


def build_manifest(path: str | Path, target: int = CHUNK_BYTES, on_chunk=None) -> Manifest:
    """The manifest of a model file or HF folder (every regular file inside it, sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        entries = tuple(build_file_entry(p, p.relative_to(path).as_posix(), target, on_chunk) for p in files)
        return Manifest(path.name, entries, folder=True)
    return Manifest(path.name, (build_file_entry(path, path.name, target, on_chunk),))
