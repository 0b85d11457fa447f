"""The one preallocated paged KV tensor, and block export/import as bytes.

Shape: [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim], planes 2 (K, V) or
1 (MLA's latent: its keys, values their first columns). A block's wire payload is
`kv[:, :, block_id]` in C order: layer-major, then K before V, then token, head, dim; little-endian
elements of the cache dtype. Its size is `KVLayout.block_bytes`.
"""
from __future__ import annotations

import numpy as np
import torch

from ember.kv.block_hash import KVLayout
from ember.util import memory

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# numpy has no bfloat16: move bytes through a same-width integer view
_NUMPY_TWIN = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.float16}
_BYTE_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu"):
        self.layout = layout
        self.num_blocks = num_blocks
        self.dtype = _TORCH_DTYPES[layout.dtype]
        shape = (layout.num_layers, layout.planes, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # Zeroed pages straight from the OS (calloc): no up-front memset of the whole pool,
        # pages are touched as blocks are first written. Zeros matter: attention reads the
        # unwritten tail of a block (masked), and 0 * garbage could be NaN.
        if torch.device(device).type == "cpu":
            pool = np.zeros(shape, dtype=_NUMPY_TWIN[self.dtype])
            # small pages: a block is a few KiB in each of the pool's layers x planes regions, and
            # numpy's huge pages would make the first block written in each region cost 2 MiB there
            memory.no_huge_pages(pool.ctypes.data, pool.nbytes)
            self.kv = torch.from_numpy(pool).view(self.dtype)
        else:
            self.kv = torch.zeros(shape, dtype=self.dtype, device=device)
        self.block_shape = (layout.num_layers, layout.planes, layout.block_size, layout.num_kv_heads, layout.head_dim)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V caches of one layer, each [num_blocks, block_size, num_kv_heads, head_dim] (a latent
        cache: the latent plane, twice)."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, -1]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def export_block(self, block_id: int) -> bytes:
        block = self.kv[:, :, block_id].contiguous().cpu()
        return block.view(_BYTE_VIEW[self.dtype]).numpy().tobytes()

    def import_block(self, block_id: int, payload: bytes | bytearray | memoryview) -> None:
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"KV block payload is {len(payload)} bytes, layout needs {self.layout.block_bytes}")
        as_int = _BYTE_VIEW[self.dtype]
        dst = self.kv[:, :, block_id].view(as_int)
        # through numpy: it reads read-only memory (a shared kvstore arena) without a copy
        src = np.frombuffer(payload, dtype=np.int16 if self.kv.element_size() == 2 else np.int32)
        if dst.is_cuda:  # one host-to-device copy of the block
            dst.copy_(torch.from_numpy(src.reshape(self.block_shape).copy()))
        else:
            np.copyto(dst.numpy(), src.reshape(self.block_shape))
