from raypaged.core.block_hash import hash_block, hash_block_tokens


def test_hash_is_stable_across_processes():
    # A fixed digest: the router and every worker must agree, whatever process computes it.
    assert hash_block(None, [1, 2, 3, 4]).hex() == hash_block(None, (1, 2, 3, 4)).hex()
    assert len(hash_block(None, [1])) == 16


def test_block_hash_depends_on_every_earlier_block():
    a = hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)
    b = hash_block_tokens([9, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4)  # only token 0 differs
    assert len(a) == 3
    assert all(x != y for x, y in zip(a, b))


def test_partial_block_has_no_hash_and_salt_changes_every_hash():
    assert len(hash_block_tokens(list(range(11)), 4)) == 2
    plain = hash_block_tokens(list(range(8)), 4)
    salted = hash_block_tokens(list(range(8)), 4, cache_salt="tenant-a")
    assert plain[0] != salted[0] and plain[1] != salted[1]
    assert hash_block_tokens(list(range(8)), 4, max_blocks=1) == plain[:1]


def test_continuing_a_chain_matches_hashing_from_scratch():
    toks = list(range(20))
    full = hash_block_tokens(toks, 4)
    assert hash_block_tokens(toks, 4, start=2, parent=full[1]) == full[2:]


def test_packed_hashing_gives_hash_blocks_own_chain_byte_for_byte():
    # The router's keys must be the workers' keys: the one-pass packing changes no digest.
    toks = [0, 1, 2**40, -5, 7, 2**63 - 1, 9, 10, 11, 12, 13]
    for salt in (None, "tenant-a"):
        extra = b"" if salt is None else b"salt:tenant-a"
        first = hash_block(None, toks[0:4], extra)
        second = hash_block(first, toks[4:8], extra)
        assert hash_block_tokens(toks, 4, salt) == [first, second]
    # digests of the per-block implementation this replaced (a changed key orphans every
    # cached block a live fleet's routers know of)
    assert [h.hex() for h in hash_block_tokens(list(range(10)), 4, "t")] == [
        "f5e92eb9b6bd9efbca6540e97d76df8c",
        "2e079dd4b33ed5e15366ee82b930cfc5"]
