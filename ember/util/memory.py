"""Where a process's resident memory goes, each part measured from its own source (torch-free).

`report(tracked)` splits this process's resident set (smaps) into:

- weights: resident pages of mapped model files (.gguf, .safetensors: the page cache's one copy,
  shared by every process mapping it) plus the resident pages (mincore) of weight tensors that
  live in anonymous memory;
- kv_pool, workspace: resident pages (mincore) of the engine's paged KV pool and its step buffers
  (a pool is zeroed lazily: only blocks once written are resident);
- kv_arena_maps: a kvstore's memfd arena, or an engine's read-only map of its site kvstore's arena;
- code: every other file mapping (libraries, Python's own files);
- heap: malloc's bytes in use (mallinfo2) less the tracked tensors allocated there;
- allocator_slack: free memory malloc holds resident (its arenas' resident pages, smaps, less
  their bytes in use, mallinfo2);
- python: pymalloc's arenas (small Python objects);
- stack: the main thread's stack;
- unaccounted: the resident size less all of the above. The parts come from different sources
  (mincore, mallinfo2, pymalloc's counters, smaps), so a part measured wrong shows up here
  (tests/test_memory_report.py holds it within 10% of the resident size).

`tracked` names the tensors' memory ranges by part: {"weights": [(address, nbytes), ...], ...}; a
negative address stands for a tensor with none to look at (resident and malloc'd, all of it).
"""
from __future__ import annotations

import bisect
import ctypes
import mmap
import re
import tempfile

PAGE = mmap.PAGESIZE
PARTS = ("weights", "kv_pool", "workspace", "kv_arena_maps", "code", "heap", "allocator_slack", "python",
         "stack", "unaccounted")
WEIGHT_FILES = (".gguf", ".safetensors", ".bin", ".pt")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.fopen.restype = ctypes.c_void_p
_libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
_mallinfo2 = getattr(_libc, "mallinfo2", None)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


ARENA_ALIGN = 64 << 20  # glibc's thread arenas: heaps of at most 64 MiB, aligned to their size


class Mapping:
    __slots__ = ("start", "end", "perms", "path", "rss")

    def __init__(self, start: int, end: int, perms: str, path: str):
        self.start, self.end, self.perms, self.path, self.rss = start, end, perms, path, 0

    @property
    def anonymous(self) -> bool:
        return self.path in ("", "[heap]", "[stack]") or self.path.startswith("[anon")


    def malloc_arena(self, following: Mapping | None) -> bool:
        """malloc's main heap ([heap]) or a thread arena's heap (an anonymous read-write mapping at a
        64 MiB boundary whose reserved rest follows it, inaccessible)."""
        if self.path == "[heap]":
            return True
        return (self.path == "" and self.perms.startswith("rw") and self.start % ARENA_ALIGN == 0
                and (self.end - self.start == ARENA_ALIGN or (following is not None and following.start == self.end
                                                              and following.perms.startswith("---"))))


_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def mappings(pid: int | str = "self") -> list[Mapping]:
    """This process's mappings with their resident bytes, in address order (/proc/PID/smaps)."""
    out: list[Mapping] = []
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            m = _HEADER.match(line)
            if m:
                out.append(Mapping(int(m[1], 16), int(m[2], 16), m[3], m[4]))
            elif line.startswith("Rss:"):
                out[-1].rss = int(line.split()[1]) * 1024
    return out


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of [address, address + nbytes) in resident pages (mincore), page-rounded."""
    if nbytes <= 0:
        return 0
    start = address - address % PAGE
    pages = -(-(address + nbytes - start) // PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        return 0  # (not a mapped range: nothing of it is resident)
    return sum(b & 1 for b in vec) * PAGE


def no_huge_pages(address: int, nbytes: int) -> None:
    """Keep [address, address + nbytes) in small pages (madvise MADV_NOHUGEPAGE): numpy asks for huge
    pages on big arrays, and a lazily touched pool would grow 2 MiB at a time in each region its
    first writes land in."""
    start = address - address % PAGE
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), 15)  # MADV_NOHUGEPAGE


def trim() -> None:
    """Give malloc's free memory back to the OS (malloc_trim): an idle engine keeps what it uses,
    not the high-water mark of its last big step."""
    if hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def malloc_info() -> tuple[int, int]:
    """(bytes in use in malloc's arenas, bytes in use in chunks of their own mappings): mallinfo2,
    all arenas."""
    if _mallinfo2 is None:
        return 0, 0
    info = _mallinfo2()
    return info.uordblks, info.hblkhd


def pymalloc_bytes() -> int:
    """Bytes in pymalloc's arenas (CPython's allocator statistics, written to a scratch file)."""
    with tempfile.NamedTemporaryFile(mode="r") as tmp:
        fp = _libc.fopen(tmp.name.encode(), b"w")
        if not fp:
            return 0
        try:
            ctypes.pythonapi._PyObject_DebugMallocStats(ctypes.c_void_p(fp))
        finally:
            _libc.fclose(ctypes.c_void_p(fp))
        text = tmp.read()
    m = re.search(r"(\d+) arenas \* (\d+) bytes/arena", text)
    return int(m[1]) * int(m[2]) if m else 0


def _dedupe(ranges, seen: set):
    out = []
    for address, nbytes in ranges:
        if nbytes > 0 and address not in seen:
            seen.add(address)
            out.append((address, nbytes))
    return out


def report(tracked: dict[str, list[tuple[int, int]]] | None = None, pid: int | str = "self") -> dict[str, int]:
    """{"rss": bytes, part: bytes for each of PARTS} of this process (see the module docstring)."""
    maps = mappings(pid)
    starts = [m.start for m in maps]
    parts = dict.fromkeys(PARTS, 0)
    for m in maps:
        if m.path == "[stack]":
            parts["stack"] += m.rss
        elif m.anonymous:
            continue  # split below: tracked tensors, malloc, pymalloc
        elif "memfd:" in m.path:
            parts["kv_arena_maps"] += m.rss
        elif m.path.split(" ")[0].endswith(WEIGHT_FILES):
            parts["weights"] += m.rss
        else:
            parts["code"] += m.rss
    seen: set[int] = set()  # a range two parts name is counted once, with the first
    allocated = 0  # tracked tensors' bytes in anonymous memory (malloc'd: counted by mallinfo2 too)
    for part, ranges in (tracked or {}).items():
        for address, nbytes in _dedupe(ranges, seen):
            if address < 0:  # no address to look at (an opaque tensor): malloc'd and in use, whole
                parts[part] += nbytes
                allocated += nbytes
                continue
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or not maps[i].anonymous:
                continue  # in a mapped file: counted with it
            parts[part] += resident_bytes(address, nbytes)
            allocated += nbytes
    in_arenas, in_own_maps = malloc_info()
    arenas = sum(m.rss for i, m in enumerate(maps) if m.malloc_arena(maps[i + 1] if i + 1 < len(maps) else None))
    parts["heap"] = max(0, in_arenas + in_own_maps - allocated)
    # free memory malloc holds resident: its arenas' resident pages less what is in use there (its
    # free counter, fordblks, also counts pages malloc_trim gave back)
    parts["allocator_slack"] = max(0, arenas - in_arenas)
    parts["python"] = pymalloc_bytes()
    rss = sum(m.rss for m in maps)
    parts["unaccounted"] = rss - sum(parts.values())
    return {"rss": rss, **parts}


def tensor_ranges(tensors) -> list[tuple[int, int]]:
    """(address, nbytes) of each tensor's whole storage (a view counts its storage once)."""
    out = []
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except NotImplementedError:  # an opaque tensor (oneDNN's packed weights): malloc'd, all of it used
            out.append((-id(t), t.numel() * t.element_size()))
            continue
        out.append((storage.data_ptr(), storage.nbytes()))
    return out


def format_mb(parts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v / 2**20:.0f} MB" for k, v in parts.items() if v)
