"""Prefix-cache hashes of full KV blocks, and the key a cached block is verified against.

Block i of a sequence (tokens `i*block_size .. (i+1)*block_size - 1`) is hashed only once
it is full. Its hash chains on its parent's:

    h(0) = digest(ROOT,   tokens of block 0, extra keys)
    h(i) = digest(h(i-1), tokens of block i, extra keys)

so equal hashes mean (up to collisions) equal whole prefixes, and a new request finds its
cached prefix by walking its own hashes from block 0 until the first miss. `extra_keys` is a
tuple of whatever else the K/V depend on besides the tokens (a LoRA id, a multimodal input's
hash); every block of a request carries the same extra keys.

Why blake2b and not Python's `hash()`: the digest is the same in every process and every
run (str hashing changes with PYTHONHASHSEED), so a router in another process, a log or a
future KV-event stream can compare hashes; 16 bytes keep the map small; hashing one block
costs about a microsecond. Its width only matters for hit rates, never for correctness:
a cached block also stores a `BlockKey` that every hit compares exactly (see BlockKey).
"""

from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b
from typing import NamedTuple

ROOT = b""  # the parent hash of a sequence's first block

HashFn = Callable[[bytes, Sequence[int], tuple], bytes]


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """16-byte blake2b digest of the parent hash, the token ids (int64) and the extra keys."""
    h = blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class BlockKey(NamedTuple):
    """What a cached block's K/V were computed from, compared in full on every hit.

    `parent_serial` is the serial of the cached block the K/V were computed after (0 for a
    sequence's first block). A serial is given to each registration in the cache and never
    reused, so a block whose parent was evicted, or replaced by a different block with the
    same hash, can no longer match anything: walking from block 0 and comparing keys proves,
    block by block, that the whole prefix is equal -- whatever the hash function does.
    """

    parent_serial: int
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()

