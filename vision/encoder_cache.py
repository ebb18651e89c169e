"""EncoderCache: image embeddings by content hash, least recently used out first, bounded in
bytes -- so an image (or a video frame) that several requests or steps carry is encoded once.
The key is the piece's embedding key (proto/pan_and_scan.py): a whole image's content hash,
or for a pan-and-scan crop the hash and its box, so a crop never stands for its image.

    get(hash)         -> the embeddings [mm_tokens_per_image, hidden], or None; a hit becomes
                         the most recently used entry
    put(hash, embeds) -> kept, evicting least recently used entries until it fits; an entry
                         larger than the whole capacity is not kept (the caller still has it)

Entries live where the encoder made them (the worker's device) in its dtype, each its own
tensor (`put` is given a clone, not a view of a batch: a view would keep the whole batch's
memory alive while counting one row of it). Entries are never modified: a caller holding a
tensor it got keeps a valid one after the entry is evicted.

Invariants (`check_integrity`): used_bytes == the sum of the entries' sizes <= capacity_bytes;
the order of entries is the order of their last use (get hit or put), oldest first.
Counters run since the cache was made: hits, misses (`get` calls), evictions.

Like vLLM's encoder cache manager, it is keyed by content, not by request, so a request
that ends does not free what another still sends; unlike it, it lives beside the encoder on
the worker (the scheduler does not budget it): what does not fit is simply encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EncoderCacheStats:
    entries: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"encoder cache capacity {capacity_bytes}: must be >= 0 (0 = off)")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # oldest use first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: str) -> bool:
        """Whether an entry is held (no use recorded, no counter moved)."""
        return content_hash in self._entries

    def get(self, content_hash: str) -> torch.Tensor | None:
        embeds = self._entries.get(content_hash)
        if embeds is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(content_hash)
        return embeds

    def put(self, content_hash: str, embeds: torch.Tensor) -> bool:
        """Keep `embeds` (which the cache then owns: never a view of a larger tensor) as
        the most recent entry; True when kept."""
        size = _nbytes(embeds)
        old = self._entries.pop(content_hash, None)
        if old is not None:
            self.used_bytes -= _nbytes(old)
        if size > self.capacity_bytes:
            return False
        while self.used_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.used_bytes -= _nbytes(evicted)
            self.evictions += 1
        self._entries[content_hash] = embeds
        self.used_bytes += size
        return True

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(entries=len(self._entries), used_bytes=self.used_bytes,
                                 capacity_bytes=self.capacity_bytes, hits=self.hits,
                                 misses=self.misses, evictions=self.evictions)

    def check_integrity(self) -> None:
        total = sum(_nbytes(t) for t in self._entries.values())
        assert total == self.used_bytes, f"entries hold {total} bytes, used_bytes says {self.used_bytes}"
        assert self.used_bytes <= self.capacity_bytes, (
            f"{self.used_bytes} bytes held, capacity {self.capacity_bytes}")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
