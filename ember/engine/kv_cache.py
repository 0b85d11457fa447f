"""The one preallocated paged KV tensor, and block export/import as bytes.

Shape: [num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim], planes 2 (K, V) or
1 (MLA's latent: its keys, values their first columns). A block's wire payload is
`kv[:, :, block_id]` in C order: layer-major, then K before V, then token, head, dim; little-endian
elements of the cache dtype. Its size is `KVLayout.block_bytes`.

Hybrid allocation (ember.engine.block_manager.KVGroups): the same bytes as
[layers per group, planes, pages, block_size, num_kv_heads, head_dim], a page one block of one KV
group's layers, a layer at its slot (its index in its group); a block on the wire is still every
layer's (the pages of its hash in each group, put back in layer order), so engines that group
differently, or not at all, exchange blocks as before.
"""
from __future__ import annotations

import numpy as np
import torch

from ember.engine.block_manager import KVGroups
from ember.kv.block_hash import KVLayout
from ember.util import memory

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# numpy has no bfloat16: move bytes through a same-width integer view
_NUMPY_TWIN = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.float16}
_BYTE_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 groups: KVGroups | None = None):
        """num_blocks: whole-model blocks the pool holds; with `groups`, `num_blocks` becomes the pages
        of the same bytes (num_blocks x layers / layers per group)."""
        self.layout = layout
        self.groups = groups
        slots = layout.num_layers
        if groups is not None:
            if groups.num_layers != layout.num_layers:
                raise ValueError(f"KV groups cover {groups.num_layers} layers, the layout has {layout.num_layers}")
            slots = groups.layers_per_group
            num_blocks = num_blocks * layout.num_layers // slots
            self._placement = [groups.placement(layer) for layer in range(layout.num_layers)]
        self.num_blocks = num_blocks
        self.dtype = _TORCH_DTYPES[layout.dtype]
        shape = (slots, layout.planes, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
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
        kv = self.layer_kv(layer_idx)
        return kv[0], kv[-1]

    def layer_kv(self, layer_idx: int) -> torch.Tensor:
        """One layer's planes [planes, num_blocks, block_size, num_kv_heads, head_dim] (with groups: its
        slot's, shared with the other groups' layers at that slot, each through its own pages)."""
        return self.kv[layer_idx if self.groups is None else self._placement[layer_idx][1]]

    def group_of(self, layer_idx: int) -> int:
        return 0 if self.groups is None else self._placement[layer_idx][0]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def export_block(self, block_id: int | tuple[int, ...]) -> bytes:
        """A block's payload; with groups `block_id` is its page in each group (BlockManager handles)."""
        if self.groups is None:
            block = self.kv[:, :, block_id].contiguous().cpu()
        else:
            block = torch.empty(self.block_shape, dtype=self.dtype)
            for layers, page in zip(self.groups.layers, block_id):
                block[list(layers)] = self.kv[:, :, page].cpu()
        return block.view(_BYTE_VIEW[self.dtype]).numpy().tobytes()

    def import_block(self, block_id: int | tuple[int, ...], payload: bytes | bytearray | memoryview) -> None:
        if len(payload) != self.layout.block_bytes:
            raise ValueError(f"KV block payload is {len(payload)} bytes, layout needs {self.layout.block_bytes}")
        as_int = _BYTE_VIEW[self.dtype]
        if self.groups is not None:  # each group's layers into its page
            src = torch.from_numpy(np.frombuffer(payload, dtype=np.int16 if self.kv.element_size() == 2 else np.int32)
                                   .reshape(self.block_shape).copy())
            for layers, page in zip(self.groups.layers, block_id):
                self.kv[:, :, page].view(as_int).copy_(src[list(layers)])
            return
        dst = self.kv[:, :, block_id].view(as_int)
        # through numpy: it reads read-only memory (a shared kvstore arena) without a copy
        src = np.frombuffer(payload, dtype=np.int16 if self.kv.element_size() == 2 else np.int32)
        if dst.is_cuda:  # one host-to-device copy of the block
            dst.copy_(torch.from_numpy(src.reshape(self.block_shape).copy()))
        else:
            np.copyto(dst.numpy(), src.reshape(self.block_shape))
