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

BlockHash = bytes  # DIGEST_SIZE-byte digest
DIGEST_SIZE = 16

_ROOT: BlockHash = b"raypaged-root-v1"


def little_endian(typecode: str, values: Sequence[int]) -> bytes:
    """The ints packed in C by `array(typecode)`, little-endian always: every host hashes (and
    reads cache deltas) alike."""
    packed = array(typecode, values)
    if sys.byteorder == "big":  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    data = len(token_ids).to_bytes(4, "little") + little_endian("q", token_ids) + extra
    return hashlib.blake2b((parent if parent is not None else _ROOT) + data,
                           digest_size=DIGEST_SIZE).digest()


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

    The same digests as hash_block per block, with the tokens packed once for the whole run:
    a router hashes every prompt it routes, and a worker every prompt it admits.
    """
    extra = salt_key(cache_salt)
    n_full = len(token_ids) // block_size
    if max_blocks is not None:
        n_full = min(n_full, max_blocks)
    if n_full <= start:
        return []
    data = little_endian("q", token_ids[start * block_size:n_full * block_size])
    step = 8 * block_size
    head = block_size.to_bytes(4, "little")  # hash_block's length field: a full block
    blake2b = hashlib.blake2b
    out: list[BlockHash] = []
    parent = parent if parent is not None else _ROOT
    for i in range(0, len(data), step):
        parent = blake2b(parent + head + data[i:i + step] + extra, digest_size=DIGEST_SIZE).digest()
        out.append(parent)
    return out
