"""Tenants' hash chains (vLLM's cache_salt): salting, shared prefixes, the block manager and the
engine keep each tenant's prefix cache its own (no cluster; the last tests load the model)."""
from __future__ import annotations

import pytest

from ember.engine.block_manager import BlockManager
from ember.engine.errors import IntegrityError
from ember.engine.sampling_params import SamplingParams
from ember.engine.sequence import Sequence
from ember.kv.block_hash import KVLayout, chain_hashes, parent_of, root_hash, tenant_salt
from ember.services.router import tenants

LAYOUT = KVLayout("sha256:abc", "float32", 16, 30, 3, 64)
ROOT = root_hash(LAYOUT)
TOKENS = list(range(100))  # 6 full blocks of 16
A, B = tenant_salt("alpha"), tenant_salt("beta")


def test_no_tenant_is_the_plain_chain():
    """Anonymous (no keys configured): exactly today's hashes, whatever shared_blocks says."""
    assert tenant_salt() == tenant_salt("", "") == b""
    plain = chain_hashes(TOKENS, 16, ROOT)
    assert chain_hashes(TOKENS, 16, ROOT, salt=b"", shared_blocks=3) == plain
    assert chain_hashes(list(range(32)), 16, ROOT, salt=b"")[1].hex() == "2ba915cdd8a6be0324196fa60086c5b2"
    assert tenants.chain("", "", TOKENS, None) == (b"", 0)


def test_each_tenant_has_its_own_chain():
    plain = chain_hashes(TOKENS, 16, ROOT)
    a, b = chain_hashes(TOKENS, 16, ROOT, salt=A), chain_hashes(TOKENS, 16, ROOT, salt=B)
    assert len(a) == len(b) == len(plain) == 6
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)
    assert a == chain_hashes(TOKENS, 16, ROOT, salt=tenant_salt("alpha")), "same tenant, same chain"
    assert chain_hashes(TOKENS, 16, ROOT, salt=tenant_salt("alpha", "s3cret"))[0] not in a, "cache_salt splits it"
    assert tenant_salt("", "s3cret") not in (b"", A)
    assert tenant_salt("ab", "c") != tenant_salt("a", "bc"), "the tenant name is length-prefixed"


def test_salted_values_are_pinned():
    # Router, prefill, decode and the kvstores must agree on a tenant's block addresses on every
    # host and release: a change here turns every tenant's cached block into a miss.
    assert tenant_salt("alpha").hex() == "ac930186639fc6b1a8c9451b27ff7c16"
    assert chain_hashes(list(range(32)), 16, ROOT, salt=A)[1].hex() == "e3e7d05649ac4802b28e0563b906d029"


def test_shared_blocks_stay_on_the_plain_chain():
    plain = chain_hashes(TOKENS, 16, ROOT)
    a = chain_hashes(TOKENS, 16, ROOT, salt=A, shared_blocks=2)
    b = chain_hashes(TOKENS, 16, ROOT, salt=B, shared_blocks=2)
    assert a[:2] == b[:2] == plain[:2], "the shared prefix's blocks are everyone's"
    assert not set(a[2:]) & set(plain) and not set(a[2:]) & set(b[2:]), "what follows is each tenant's"
    assert a[2:] != chain_hashes(TOKENS, 16, ROOT, salt=A)[2:], "block 2's parent is the shared block 1, salted"


@pytest.mark.parametrize("shared", [0, 2, 3, 5])
@pytest.mark.parametrize("start", [1, 3, 4])
def test_extending_a_salted_chain_equals_hashing_it_whole(shared, start):
    whole = chain_hashes(TOKENS, 16, ROOT, salt=A, shared_blocks=shared)
    assert chain_hashes(TOKENS, 16, ROOT, start_parent=whole[start - 1], start_block=start, salt=A,
                        shared_blocks=shared) == whole[start:]


def test_parent_of_salts_only_at_the_boundary():
    h = b"\x01" * 16
    assert parent_of(2, h, A, 3) == h and parent_of(4, h, A, 3) == h and parent_of(3, h, b"", 3) == h
    assert parent_of(3, h, A, 3) != h and parent_of(3, h, A, 3) != parent_of(3, h, B, 3)


# -- the block manager: a prefix cache per tenant --------------------------------------------------
def seq(tokens, rid, salt=b"", shared=0):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams(), seed=0, cache_salt=salt, shared_blocks=shared)


def run(bm, s):
    """Admit s (counting its prefix hits), compute it whole, free it: its blocks stay cached."""
    hits = bm.match_prefix(s)
    bm.allocate(s, hits)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed(s)
    bm.free(s)
    return len(hits)


def test_block_manager_keeps_tenants_apart():
    bm = BlockManager(64, 16, ROOT)
    prompt = TOKENS[:81]  # 5 full blocks and one token to compute
    assert run(bm, seq(prompt, "a1", A)) == 0
    assert run(bm, seq(prompt, "b1", B)) == 0, "tenant B never hits tenant A's blocks"
    assert run(bm, seq(prompt, "anon")) == 0, "nor does an anonymous request"
    assert run(bm, seq(prompt, "a2", A)) == 5, "tenant A's own repeat hits"
    s = seq(prompt, "a3", A)
    bm.allocate(s, bm.match_prefix(s))
    assert s.block_hashes == chain_hashes(prompt, 16, ROOT, salt=A)[:5], "the pool's hashes are the router's"
    bm.free(s)


def test_block_manager_shares_the_declared_prefix():
    bm = BlockManager(64, 16, ROOT)
    a_prompt = TOKENS[:48] + [500 + i for i in range(33)]  # 3 shared blocks, then tenant A's own
    b_prompt = TOKENS[:48] + [900 + i for i in range(33)]
    assert run(bm, seq(a_prompt, "a", A, shared=3)) == 0
    assert run(bm, seq(b_prompt, "b", B, shared=3)) == 3, "B reuses the shared blocks, and only those"
    assert run(bm, seq(a_prompt, "b-copy", B, shared=3)) == 3, "B sending A's prompt reaches no private block"
    assert run(bm, seq(a_prompt, "a-again", A, shared=3)) == 5


# -- shared prefixes as the router finds them, with the real tokenizer -----------------------------
SYSTEM = ("You are the archivist of the harbour town of Eastmere. Answer questions about its records, "
          "its fishing boats, its merchant ships and the lighthouse keeper's weather notes, briefly and "
          "accurately, and say so when the records do not tell.")


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    return Tokenizer.from_folder(model_folder(model_path))


def test_shared_prefix_blocks_are_token_exact(tokenizer):
    shared = tenants.SharedPrefixes(tokenizer, [SYSTEM], 16)
    system_part = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                 add_generation_prompt=False))
    assert len(system_part) >= 48
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                           {"role": "user", "content": "How many boats?"}]))
    assert chat[:len(system_part)] == system_part
    assert shared.blocks(chat) == len(system_part) // 16, "every block inside the system message is shared"
    other = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "How many boats?"}]))
    assert shared.blocks(other) == 0, "a chat without that system message shares nothing"
    text = tokenizer.encode(SYSTEM + " Question: how many boats were there?")
    n = shared.blocks(text)
    assert 1 <= n <= len(tokenizer.encode(SYSTEM)) // 16, "as a text prompt too, never past the shared text"
    assert tenants.chain("alpha", "", chat, shared) == (A, len(system_part) // 16)
    assert tenants.chain("", "", chat, shared) == (b"", 0), "no tenant: the plain chain, nothing to mark"
    assert tenants.SharedPrefixes(tokenizer, [], 16).blocks(chat) == 0


# -- the engine: a tenant's KV is found, imported and exported on its own chain ---------------------
def test_engine_prefix_cache_per_tenant(make_engine):
    engine = make_engine(kv_cache_mb=64)
    prompt = list(range(1000, 1081))  # 5 full blocks
    params = SamplingParams(max_tokens=2)

    def cached(rid, salt, shared=0):
        engine.add_request(prompt, params, rid, cache_salt=salt, shared_blocks=shared)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    return out
    first = cached("a1", A)
    root = engine.block_manager.root_hash
    assert first.cached_tokens == 0 and first.block_hashes[:5] == chain_hashes(prompt, 16, root, salt=A)
    assert cached("b1", B).cached_tokens == 0
    assert cached("a2", A).cached_tokens == 80
    assert cached("a3", A, shared=2).cached_tokens == 0, "a shared prefix is on the plain chain, not A's"
    assert cached("b2", B, shared=2).cached_tokens == 32, "B's shared blocks hit A's; the rest is B's own"


def test_import_checks_the_tenant_chain(make_engine):
    source, dest = make_engine(kv_cache_mb=64), make_engine(kv_cache_mb=64)
    prompt = list(range(2000, 2049))  # 3 full blocks
    source.add_request(prompt, SamplingParams(max_tokens=1), "src", cache_salt=A)
    while source.has_unfinished():
        source.step()
    hashes = chain_hashes(prompt, 16, source.block_manager.root_hash, salt=A)
    payloads = source.export_blocks(hashes)
    with pytest.raises(IntegrityError):
        dest.import_blocks(prompt, hashes, payloads)  # not the plain chain's blocks
    with pytest.raises(IntegrityError):
        dest.import_blocks(prompt, hashes, payloads, cache_salt=B)
    assert dest.import_blocks(prompt, hashes, payloads, cache_salt=A) == 3
    dest.add_request(prompt, SamplingParams(max_tokens=1), "b", cache_salt=B)
    dest.add_request(prompt, SamplingParams(max_tokens=1), "a", cache_salt=A)
    outs = {}
    while dest.has_unfinished():
        outs.update({o.request_id: o for o in dest.step() if o.finished})
    assert outs["a"].cached_tokens == 48 and outs["b"].cached_tokens == 0
