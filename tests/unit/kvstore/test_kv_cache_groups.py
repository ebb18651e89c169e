"""Which layers share a block table (kvstore/kv_cache_groups.py): the released Gemma 3
layouts, one group for a model of one kind, the blocks a request holds per group, and the
capacity line the worker logs; a runner's KV tensors hold `group_size` layer slots and each
layer writes its own group's blocks."""

import torch
from tests.support.runner_helpers import chunked_prefill_logits, make_runner

from kvstore.kv_cache_groups import blocks_per_request, group_layers, kv_capacity

SLIDING = 1024


def gemma3(num_layers: int) -> list[int | None]:
    """Gemma 3's layer windows: every sixth layer global."""
    return [None if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]


def test_gemma3_12b_has_a_global_group_and_five_sliding_groups_of_eight():
    layout = group_layers(gemma3(48))  # 8 global, 40 sliding
    assert layout.group_size == 8
    assert layout.windows == (None,) + (SLIDING,) * 5
    assert layout.groups[0].layers == tuple(range(5, 48, 6))
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(48))
    places = layout.layer_places(48)
    assert places[5] == (0, 0) and places[47] == (0, 7) and places[0] == (1, 0)


def test_gemma3_4b_pads_its_last_sliding_group():
    layout = group_layers(gemma3(34))  # 5 global, 29 sliding
    assert layout.group_size == 5
    assert [len(g.layers) for g in layout.groups] == [5, 5, 5, 5, 5, 5, 4]


def test_one_kind_is_one_group_of_every_layer():
    for windows in ([None] * 4, [48] * 4):
        layout = group_layers(windows)
        assert layout.num_groups == 1 and layout.group_size == 4 and layout.windows == (windows[0],)
        assert layout.layer_places(4) == [(0, i) for i in range(4)]


def test_kinds_of_nearly_equal_size_make_one_padded_group_each():
    layout = group_layers([None, 8, None, 8, 8])  # 2 global, 3 sliding: not under 1.25 x 2
    assert layout.group_size == 2 and layout.num_groups == 3
    layout = group_layers([None] * 5 + [8] * 6)  # 6 < 1.25 x 5: one group each, padded to 6
    assert layout.group_size == 6 and [len(g.layers) for g in layout.groups] == [5, 6]


def test_blocks_a_request_holds_and_the_capacity_line():
    layout = group_layers([64, 64, 64, 64, 64, None])
    assert blocks_per_request(layout, 1024, 16) == [64] + [5] * 5  # cdiv(63, 16) + 1 in a window
    assert blocks_per_request(layout, 40, 16) == [3] * 6  # shorter than the window
    line = kv_capacity(layout, 890, 16, 1024)
    assert "a request of 1024 tokens holds 64+5+5+5+5+5 = 89 blocks" in line
    assert line.endswith("maximum concurrency for 1024 tokens per request: 10.00x")


def test_the_runner_keeps_group_size_slots_and_each_layer_writes_its_group(family_model_dir):
    """The tiny Gemma 3 (two sliding layers, a global one): three groups of one layer, so the
    cache has one layer slot; a prefill writes each position into every group's block."""
    runner = make_runner(family_model_dir("gemma3"), block_size=4, num_blocks=8)
    assert runner.kv_layout.windows == (None, 48, 48) and runner.kv_cache.kv.shape[1] == 1
    info = runner.describe()
    assert list(info.kv_cache_group_windows) == [0, 48, 48] and info.kv_cache_group_size == 1
    chunked_prefill_logits(runner, list(range(10, 18)), [8], [0, 1])  # groups' blocks 0-1, 2-3, 4-5
    written = runner.kv_cache.kv[0, 0].abs().sum(dim=(1, 2, 3))
    assert bool((written[:6] > 0).all()) and bool((written[6:] == 0).all())
    assert not torch.equal(runner.kv_cache.kv[0, 0, 0], runner.kv_cache.kv[0, 0, 2])  # other layers' K
