"""A prefix-cache hit across KV cache groups (kvstore/kv_cache_groups.py), as vLLM's hybrid
KV cache manager defines it: a hit of m blocks holds for every group.

- Group 0 (the anchor; full attention whenever the model has a full layer) walks its cached
  chain from block 0, each block verified against its BlockKey (kvstore/block_hash.py): its
  hit is a prefix of blocks whose serials prove the whole prefix's tokens and extra keys.
- Any other group's block i is cached under the same hash, keyed by the serial of the
  anchor's cached block i (`BlockKey.parent_serial`): matching it proves the same prefix,
  since serials are never reused.
- A full group needs all m blocks; a sliding group only the blocks the window of the first
  recomputed token (position m * block_size) reaches: blocks `first_needed(m)` to m - 1. Its
  table holds holes (None) before them.

`find_hit` is the lookup (KVCacheManager.find_cached_prefix); `hit_length` finds the largest m
that every group and the caller's `fit` accept: the groups' answers only shrink m, and m = 0 is
a hit for everyone, so it ends.
"""

from collections.abc import Callable, Mapping, Sequence

from kvstore.block_hash import BlockExtraKeys, HashFn, block_hash_at
from kvstore.block_pool import KVBlock

# block index -> the group's verified cached block for it, or None (no hit there)
Lookup = Callable[[int], KVBlock | None]


class PrefixHit(list):
    """A hit's blocks. As a list: the anchor group's (its length is the hit's block count);
    `groups[g]`: group g's, with None for a sliding group's blocks behind the window."""

    __slots__ = ("groups",)

    def __init__(self, groups: Sequence[list[KVBlock | None]]):
        super().__init__(groups[0])
        self.groups = tuple(groups)


def first_needed(num_blocks: int, block_size: int, window: int | None) -> int:
    """The first block a hit of `num_blocks` blocks needs in a group with `window`: the one
    holding the oldest key the next query (position num_blocks * block_size) sees."""
    if window is None:
        return 0
    return max(0, num_blocks * block_size - window + 1) // block_size


def group_hit_length(lookup: Lookup, num_blocks: int, block_size: int, window: int | None) -> int:
    """The largest m <= num_blocks whose needed blocks (`first_needed(m)` .. m - 1) the
    group has cached. Each block is looked up at most once."""
    end = num_blocks
    while end > 0:
        first = first_needed(end, block_size, window)
        i = end - 1
        while i >= first and lookup(i) is not None:
            i -= 1
        if i < first:
            return end
        end = i  # a miss at i: a hit ends at or before it
    return 0


def hit_length(anchor_length: int, lookups: Sequence[Lookup], windows: Sequence[int | None],
               block_size: int, fit: Callable[[int], int] | None) -> int:
    """The largest hit <= `anchor_length` blocks that `fit` and every non-anchor group (its
    lookup and window) accept."""
    m = fit(anchor_length) if fit is not None else anchor_length
    while m > 0:
        before = m
        for lookup, window in zip(lookups, windows):
            m = group_hit_length(lookup, m, block_size, window)
        if fit is not None:
            m = fit(m)
        if m == before:
            break
    return m


def find_hit(cached_groups: Sequence[Mapping[bytes, KVBlock]], windows: Sequence[int | None], block_size: int,
             hash_fn: HashFn, token_ids: Sequence[int], hashes: list[bytes],
             extra_keys: BlockExtraKeys | None, fit: Callable[[int], int] | None) -> list[KVBlock]:
    """The hit of `token_ids` (at most (len - 1) // block_size blocks) in the groups' caches
    `cached_groups` (their `windows`), extending `hashes` as far as the walk goes: the
    anchor's blocks, or with several groups a PrefixHit. Every hit is verified against
    its block's key (tokens and extra keys), never trusted on the hash."""
    bs, cached = block_size, cached_groups[0]
    keys_of = extra_keys.get if extra_keys else None
    blocks: list[KVBlock] = []
    parent_serial = 0
    for i in range((len(token_ids) - 1) // bs):
        tokens = tuple(token_ids[i * bs:(i + 1) * bs])
        keys = () if keys_of is None else keys_of(i, ())
        block = cached.get(block_hash_at(hashes, i, tokens, keys, hash_fn))
        if block is None or block.block_key != (parent_serial, tokens, keys):
            break
        blocks.append(block)
        parent_serial = block.serial
    if len(cached_groups) == 1:
        return blocks[:fit(len(blocks))] if fit is not None and blocks else blocks
    lookups = [_group_lookup(group, blocks, bs, token_ids, hashes, keys_of) for group in cached_groups[1:]]
    m = hit_length(len(blocks), lookups, windows[1:], bs, fit)
    groups: list[list[KVBlock | None]] = [blocks[:m]]
    for lookup, window in zip(lookups, windows[1:]):
        first = first_needed(m, bs, window)
        groups.append([None] * first + [lookup(i) for i in range(first, m)])
    return PrefixHit(groups)


def _group_lookup(cached: Mapping[bytes, KVBlock], anchor: list[KVBlock], bs: int, token_ids: Sequence[int],
                  hashes: list[bytes], keys_of) -> Lookup:
    """Block index (< len(anchor)) -> the group's cached block holding the content of the
    anchor's block there, verified against its key (parent serial: the anchor block's), or
    None. Memoized."""
    memo: dict[int, KVBlock | None] = {}

    def lookup(i: int) -> KVBlock | None:
        if i not in memo:
            block = cached.get(hashes[i])
            key = (anchor[i].serial, tuple(token_ids[i * bs:(i + 1) * bs]),
                   () if keys_of is None else keys_of(i, ()))
            memo[i] = block if block is not None and block.block_key == key else None
        return memo[i]
    return lookup
