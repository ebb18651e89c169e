"""KV cache groups: which layers share a block table, and how a block's memory is laid out.

A model whose layers attend differently (Gemma 3: five sliding-window layers for every
global one) keeps K/V per group of layers of one kind: a sliding group gives back its
blocks wholly behind the window as a request advances, the global group keeps them all.
Every group's blocks come from one pool (kvstore/block_pool.py), so a block must be the
same size in every group: each group holds the same number of layers, `group_size` (vLLM's
uniform page size). Layers of one kind are split in runs of `group_size`, in layer order:

- one kind only (Llama, Qwen, Mistral, a Gemma 3 with every layer global): one group of
  every layer -- exactly the layout of a model without groups;
- several kinds: `group_size` is the smallest kind's layer count (its layers make one
  group), so the larger kinds make several groups; where the largest has fewer than 1.25x
  the smallest's layers, `group_size` is the largest count instead (one group per kind, the
  smaller ones padded) -- fewer groups for little padding. A kind's last group may hold
  fewer layers than `group_size`: its blocks leave the other slots unused (Gemma 3 4B:
  5 global and 29 sliding layers make one global group of 5 and sliding groups of
  5, 5, 5, 5, 5, 4).

Full-attention groups come first: group 0 anchors prefix caching (its cached chain proves
a prefix; kvstore/kv_cache_manager.py), and a full group keeps every block of a request.

The worker's KV tensors have `group_size` layer slots (kvstore/cache_tensors.py): block b
of slot s holds, for the group that block belongs to now, the K/V of that group's s-th
layer. A layer reads its group's block table and its slot's cache.
"""

from collections.abc import Sequence
from dataclasses import dataclass

PAD_RATIO = 1.25  # one group per kind while the largest kind has fewer than this x the smallest's layers


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # the layers' sliding window (keys a query sees: itself + window - 1); None: full
    layers: tuple[int, ...]  # in layer order; layers[s] uses slot s


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    group_size: int  # layer slots per block: the most layers a group holds

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each group's window, in group order (what the scheduler needs)."""
        return tuple(group.window for group in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def layer_places(self, num_layers: int) -> list[tuple[int, int]]:
        """(group, slot) of each layer."""
        places: list[tuple[int, int] | None] = [None] * num_layers
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                places[layer] = (g, slot)
        assert all(p is not None for p in places), f"layers without a group: {self}"
        return places  # type: ignore[return-value]

    def describe(self) -> str:
        """One line for the worker's log: each group's kind and layers."""
        kinds = ", ".join(f"group {g}: {'full' if grp.window is None else f'window {grp.window}'} "
                          f"({len(grp.layers)} layers)" for g, grp in enumerate(self.groups))
        return f"{self.num_groups} KV cache group(s) of {self.group_size} layer slots: {kinds}"


def group_layers(windows: Sequence[int | None]) -> KVCacheLayout:
    """The layout for a model whose layer i attends with `windows[i]` (None: full)."""
    if not windows:
        raise ValueError("a model has at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    # full attention first, then windows from the largest
    order = sorted(kinds, key=lambda w: (w is not None, -(w or 0)))
    if len(order) == 1:
        return KVCacheLayout((KVCacheGroup(order[0], tuple(kinds[order[0]])),), len(windows))
    counts = [len(kinds[w]) for w in order]
    size = max(counts) if max(counts) < PAD_RATIO * min(counts) else min(counts)
    groups = tuple(KVCacheGroup(w, tuple(kinds[w][i:i + size]))
                   for w in order for i in range(0, len(kinds[w]), size))
    return KVCacheLayout(groups, size)


def blocks_per_request(layout: KVCacheLayout, num_tokens: int, block_size: int) -> list[int]:
    """Blocks a request of `num_tokens` tokens holds at most in each group while it decodes:
    all of its blocks in a full group; in a sliding group those holding the window of its
    next query (after the blocks wholly behind it went back)."""
    full = -(-num_tokens // block_size)
    return [full if g.window is None else min(full, -(-(g.window - 1) // block_size) + 1)
            for g in layout.groups]


def kv_capacity(layout: KVCacheLayout, num_blocks: int, block_size: int, max_model_len: int) -> str:
    """One line for the worker's log, as vLLM reports it: the pool, the blocks a request of
    `max_model_len` tokens holds in each group, and how many such requests fit at once."""
    per_group = blocks_per_request(layout, max_model_len, block_size)
    need = sum(per_group)
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} token slots, "
            f"{num_blocks // layout.num_groups * block_size} tokens in each of {layout.num_groups} group(s)); "
            f"a request of {max_model_len} tokens holds {'+'.join(map(str, per_group))} = {need} blocks: "
            f"maximum concurrency for {max_model_len} tokens per request: {num_blocks / need:.2f}x")
