"""Tenants' prefix caches: which hash chain a request's KV blocks lie on (ember.kv.block_hash).

Each request's salt comes from its tenant (services/router/auth.py) and the client's optional
`cache_salt`; the router sends it, with the count of leading blocks inside a shared prefix, in
its Prefill and Decode requests, so every service hashes the prompt's blocks alike. Tenants
therefore never hit, nor see (`cached_tokens`, `cached_blocks`), each other's blocks, while one
tenant's requests share theirs. No tenant and no salt (no API keys configured): the plain chain,
today's hashes.

`router.shared_prefixes` declares texts every tenant may share (system prompts): the prompt's
leading full blocks that are token for token inside one of them stay on the plain chain. Each
text is matched as the router tokenizes prompts: as a text prompt, and as a chat's system
message rendered by the model's chat template (without a generation prompt). A block counts
only when all of its tokens, and all before it, are the shared text's: nothing a tenant wrote
ever lands in a shared block.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from jinja2.exceptions import TemplateError

from ember.kv.block_hash import tenant_salt

log = logging.getLogger("ember.router")


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class SharedPrefixes:
    """The token sequences of `router.shared_prefixes`, and how many leading blocks of a prompt
    lie inside one."""

    def __init__(self, tokenizer, texts: Sequence[str], block_size: int):
        self.block_size = block_size
        renderings: set[tuple[int, ...]] = set()
        for text in texts:
            if not text:
                continue
            renderings.add(tuple(tokenizer.encode(text)))
            try:
                chat = tokenizer.apply_chat_template([{"role": "system", "content": text}],
                                                     add_generation_prompt=False)
            except (ValueError, TemplateError) as e:  # a template that refuses a lone system message
                log.warning("router.shared_prefixes: the chat template cannot render a system message (%s); "
                            "shared as a text prompt only", e)
            else:
                renderings.add(tuple(tokenizer.encode(chat)))
        # only whole blocks can be shared: drop what is shorter than one
        self.token_ids = sorted((r for r in renderings if len(r) >= block_size), key=len, reverse=True)

    def blocks(self, prompt: Sequence[int]) -> int:
        """Leading full blocks of `prompt` inside a shared prefix (0 without one)."""
        best = max((_common_prefix(prompt, shared) for shared in self.token_ids), default=0)
        return best // self.block_size


def chain(tenant: str, cache_salt: str, prompt: Sequence[int], shared: SharedPrefixes | None) -> tuple[bytes, int]:
    """A request's (salt, shared_blocks): b"", 0 for the plain chain (no tenant, no cache_salt)."""
    salt = tenant_salt(tenant, cache_salt)
    if not salt or shared is None:
        return salt, 0
    return salt, shared.blocks(prompt)
