"""Chain hashes of KV blocks: stable, chained, layout-sensitive (torch-free)."""
from ember.kv.block_hash import KVLayout, block_hash, chain_hashes, root_hash

LAYOUT = KVLayout("sha256:abc", "float32", 16, 30, 3, 64)


def test_only_full_blocks_are_hashed():
    root = root_hash(LAYOUT)
    assert len(chain_hashes(list(range(15)), 16, root)) == 0
    assert len(chain_hashes(list(range(47)), 16, root)) == 2


def test_hash_depends_on_the_whole_prefix():
    root = root_hash(LAYOUT)
    a = chain_hashes(list(range(32)), 16, root)
    b = chain_hashes([99] + list(range(1, 32)), 16, root)
    assert a[0] != b[0] and a[1] != b[1]  # block 1 differs only through its parent


def test_hash_depends_on_layout_and_model():
    tokens = list(range(16))
    other_dtype = KVLayout("sha256:abc", "bfloat16", 16, 30, 3, 64)
    other_model = KVLayout("sha256:def", "float32", 16, 30, 3, 64)
    hashes = {chain_hashes(tokens, 16, root_hash(layout))[0] for layout in (LAYOUT, other_dtype, other_model)}
    assert len(hashes) == 3


def test_extending_a_chain_equals_hashing_it_whole():
    root = root_hash(LAYOUT)
    tokens = list(range(100))
    whole = chain_hashes(tokens, 16, root)
    tail = chain_hashes(tokens, 16, root, start_parent=whole[2], start_block=3)
    assert whole[3:] == tail
    assert whole[0] == block_hash(root, tokens[:16])


def test_known_values_are_pinned():
    # Every service on every host, and every release, must give a block the same address:
    # a change here silently turns every cached block into a miss. Change deliberately.
    assert root_hash(LAYOUT).hex() == "494ba6695d4530c4f4f496a29d4ff1dc"
    assert chain_hashes(list(range(32)), 16, root_hash(LAYOUT))[1].hex() == "2ba915cdd8a6be0324196fa60086c5b2"
    assert LAYOUT.block_bytes == 16 * 46080
