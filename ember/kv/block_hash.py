"""Content addresses of KV-cache blocks, shared by every service (torch-free).

hash(block i) = BLAKE2b-128(key=seed, parent_hash || token_ids of block i as uint32 LE).
The chain starts from a root hash over the `KVLayout`, so a block's identity covers the
model weights (fingerprint), KV dtype, block size and layer/head shape: two services
agree on a hash only if the bytes behind it are interchangeable. Only full blocks are
hashed; a partial tail block has no address.

Tenants (vLLM's `cache_salt`): a request may carry a salt (`tenant_salt`: its tenant and the
client's own cache salt) and a count of leading blocks inside a prefix the deployment shares
(`shared_blocks`). Those blocks hash as above; the first block after them hashes from its
parent mixed with the salt (`parent_of`), so it and every later block lie on the tenant's own
chain: a block's identity then covers whose it is. No salt (anonymous) is the plain chain.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

HASH_SEED = b"ember-kv-block-v1"
HASH_BYTES = 16
SALT_KEY = b"ember-kv-salt-v1"  # the salt's hashes are keyed apart from the blocks'
MAX_SALT_BYTES = 64

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    # 2: a K and a V plane per layer; 1: one latent plane (MLA: num_kv_heads 1, head_dim the latent's
    # width, values the first columns of the keys)
    planes: int = 2

    @property
    def bytes_per_token(self) -> int:
        return self.planes * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def canonical(self) -> bytes:
        fields = asdict(self)
        if fields["planes"] == 2:  # (K, V layouts hash as they did before latent layouts existed)
            del fields["planes"]
        return "|".join(f"{k}={v}" for k, v in sorted(fields.items())).encode()


def root_hash(layout: KVLayout) -> bytes:
    return hashlib.blake2b(layout.canonical(), key=HASH_SEED, digest_size=HASH_BYTES).digest()


def block_hash(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    payload = parent_hash + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(payload, key=HASH_SEED, digest_size=HASH_BYTES).digest()


def tenant_salt(tenant: str = "", cache_salt: str = "") -> bytes:
    """The salt of a tenant's chain, from its name and the client's optional `cache_salt`;
    b"" (the plain chain) when both are empty."""
    if not tenant and not cache_salt:
        return b""
    t = tenant.encode()
    payload = b"t" + struct.pack("<I", len(t)) + t + cache_salt.encode()
    return hashlib.blake2b(payload, key=SALT_KEY, digest_size=HASH_BYTES).digest()


def parent_of(block: int, previous: bytes, salt: bytes = b"", shared_blocks: int = 0) -> bytes:
    """What block number `block` hashes from: `previous` (the root for block 0, else the hash of
    block `block - 1`), mixed with `salt` at the first block past the shared prefix."""
    if not salt or block != shared_blocks:
        return previous
    return hashlib.blake2b(b"p" + previous + salt, key=SALT_KEY, digest_size=HASH_BYTES).digest()


def chain_hashes(token_ids: Sequence[int], block_size: int, root: bytes,
                 start_parent: bytes | None = None, start_block: int = 0,
                 salt: bytes = b"", shared_blocks: int = 0) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    `start_parent` is the hash of block `start_block - 1` (the root when starting at 0),
    so callers can extend a chain without rehashing it. `salt` and `shared_blocks`: the
    request's tenant chain (see the module's doc); the defaults are the plain chain.
    """
    parent = root if start_parent is None else start_parent
    hashes = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = block_hash(parent_of(i, parent, salt, shared_blocks), token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes
