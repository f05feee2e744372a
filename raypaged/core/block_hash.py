"""Chain hash of full token blocks, shared by the router and the workers.

block i's hash = H(hash of block i-1, the block's token ids, extra keys such as cache_salt),
so a block's hash names its whole prefix: equal hashes mean equal prefixes (up to collisions of
a 128-bit BLAKE2b digest). Stable across processes and machines, unlike Python's hash().
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

BlockHash = bytes  # 16-byte digest

_ROOT: BlockHash = b"raypaged-root-v1"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent if parent is not None else _ROOT)
    # array('q') packs the ints in C; little-endian always, so every host hashes alike.
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # pragma: no cover
        tokens.byteswap()
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    h.update(extra)
    return h.digest()


def salt_key(cache_salt: str | None) -> bytes:
    """Extra key that isolates a request's prefix cache; every block of the chain carries it."""
    return b"" if not cache_salt else b"salt:" + cache_salt.encode()


def hash_block_tokens(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None,
    max_blocks: int | None = None, start: int = 0, parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (a trailing partial block has none).

    `start`/`parent` continue an existing chain: hash blocks from block index `start` on, with
    `parent` the hash of block `start - 1`.
    """
    extra = salt_key(cache_salt)
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    out: list[BlockHash] = []
    for i in range(start, n_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out
