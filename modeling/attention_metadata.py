"""What a step's attention reads beside the tokens: the decoder's (modeling/decoder.py) input
contract, built by the worker's persistent batch (worker_svc/input_batch.py) into the flat
batch (worker_svc/batch.py).

Each KV cache group g of the model (kvstore/kv_cache_groups.py) writes position p's K/V to
slot `block_tables[g][p // block_size] * block_size + p % block_size` and reads through its
own table, so `groups[g]` holds that group's slot mapping, block table tensor and attention
plan; the layers of group g use it. `bidir_spans`: each row's bidirectional span (Gemma 3's
image soft tokens see each other both ways), None when no row of the step is an image's.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupAttention:
    """One KV cache group's view of the step."""

    slot_mapping: torch.Tensor  # int32 [T]: where each row's K/V go in this group's blocks (-1: nowhere)
    block_tables: torch.Tensor  # int32 [R, max_blocks]; past a request's blocks: finite block ids
    plan: object  # the backend's attention plan for this group's window, shared by its layers


@dataclass(frozen=True)
class AttentionMetadata:
    groups: tuple[GroupAttention, ...]  # one per KV cache group
    seq_lens: torch.Tensor  # int32 [R]
    query_start_loc: torch.Tensor  # int32 [R + 1]
    # int32 [T, 2]: each row's image [start, end), [0, 0] for text; None: no image row this step
    bidir_spans: torch.Tensor | None = None
