"""Prefix-cache hashes of full KV blocks, and the key a cached block is verified against.

Block i of a sequence (tokens `i*block_size .. (i+1)*block_size - 1`) is hashed only once
it is full. Its hash chains on its parent's:

    h(0) = digest(ROOT,   tokens of block 0, extra keys)
    h(i) = digest(h(i-1), tokens of block i, extra keys)

so equal hashes mean (up to collisions) equal whole prefixes, and a new request finds its
cached prefix by walking its own hashes from block 0 until the first miss.

Extra keys are per block: a tuple of whatever else block i's K/V depend on besides its
tokens and its parent (e.g. the images whose soft tokens lie in it). A request's extra keys
are a `BlockExtraKeys` -- block index -> that block's tuple, a block not in it having `()`
-- so a text-only request passes an empty mapping (or None) and hashes exactly as before,
and a block holding no image keeps `()`: a text prefix shared by requests with different
images still hits, while every block after an image chains on the image's key.
`span_block_keys` builds one from token ranges.

Why blake2b and not Python's `hash()`: the digest is the same in every process and every
run (str hashing changes with PYTHONHASHSEED), so a router in another process, a log or a
future KV-event stream can compare hashes; 16 bytes keep the map small; hashing one block
costs about a microsecond. Its width only matters for hit rates, never for correctness:
a cached block also stores a `BlockKey` that every hit compares exactly (see BlockKey).
"""

from array import array
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from hashlib import blake2b
from typing import NamedTuple

ROOT = b""  # the parent hash of a sequence's first block

HashFn = Callable[[bytes, Sequence[int], tuple], bytes]  # (parent, block's tokens, block's extra keys)
# Block index -> the extra keys of that block of a sequence; a block not in it has ().
BlockExtraKeys = Mapping[int, tuple]


def hash_block(parent: bytes, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """16-byte blake2b digest of the parent hash, the token ids (int64) and the extra keys."""
    h = blake2b(parent, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_hash_at(hashes: list[bytes], i: int, tokens: Sequence[int], keys: tuple, hash_fn: HashFn) -> bytes:
    """hashes[i] of a sequence whose hash list is `hashes`, computed and appended if the list
    stops at i (`tokens`, `keys`: block i's)."""
    if i == len(hashes):
        hashes.append(hash_fn(hashes[i - 1] if i else ROOT, tokens, keys))
    return hashes[i]


def span_block_keys(spans: Iterable[tuple[int, int, Hashable]], block_size: int) -> dict[int, tuple]:
    """The BlockExtraKeys of a sequence whose positions `start <= p < end` depend on `key`,
    for each (start, end, key) of `spans` (non-empty ranges, in order): each key goes to
    every block its range overlaps, in the order given. O(blocks the spans touch)."""
    keys: dict[int, list] = {}
    for start, end, key in spans:
        assert 0 <= start < end, f"empty or negative span [{start}, {end})"
        for i in range(start // block_size, (end - 1) // block_size + 1):
            keys.setdefault(i, []).append(key)
    return {i: tuple(k) for i, k in keys.items()}


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
    extra_keys: tuple = ()  # this block's own (BlockExtraKeys)

