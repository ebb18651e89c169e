"""Prefix-aware routing: which worker a new (or re-routed) request goes to.

The score, in the spirit of KV-aware routers (Dynamo's cost = overlap weight x blocks to
prefill + blocks already active; llm-d's prefix scorer beside a load scorer), counts the
work a worker would have after taking the request, as a fraction of its KV capacity:

    cost(w) = (load_tokens(w) + prefix_weight * (len(tokens) - hit_tokens(w))) / capacity(w)

  load_tokens(w)  tokens of every request already there (prompt + outputs so far);
  hit_tokens(w)   tokens of the request's prefix w has in its prefix cache now
                  (BatchScheduler.cached_prefix_tokens, with the request's images in the
                  block keys, as admission looks them up): those are not computed again;
                  plus the soft tokens of the request's images after that prefix whose
                  embeddings w holds (BatchScheduler.held_image_tokens: its scheduler's
                  mirror of w's encoder cache, scheduler_svc/policy/encoder_budget.py): those are
                  not encoded again -- a camera's next question, whose window of frames
                  moved on by one, goes where its other frames are;
  capacity(w)     tokens w's KV blocks hold (num_blocks * block_size).

The lowest cost wins; ties go to the lower load, then to the first worker given. With no
hits anywhere this is least-loaded routing (for equal capacities). A hit of H tokens
outweighs up to H * prefix_weight tokens of extra load: a worker holding a 2,000-token
prefix still gets the request unless it carries more than 2,000 tokens of work beyond
another's -- "much more loaded" measured in the same unit as the saving. prefix_weight 0
turns prefix awareness off; a larger one favours hits harder.
"""

from collections.abc import Callable, Sequence
from typing import TypeVar

from proto.messages import MultiModalInput
from scheduler_svc.policy.batching import BatchScheduler

T = TypeVar("T")


def route_cost(scheduler: BatchScheduler, token_ids: Sequence[int], prefix_weight: float = 1.0,
               mm_inputs: Sequence[MultiModalInput] = (), hashes: dict | None = None) -> float:
    """cost(w) above for one worker's scheduler (`mm_inputs`: the images in token_ids;
    `hashes`: the request's block hashes so far, shared across the workers looked at)."""
    hit = 0
    if prefix_weight:
        hit = scheduler.cached_prefix_tokens(token_ids, mm_inputs, hashes)
        if mm_inputs:
            hit += scheduler.held_image_tokens(mm_inputs, hit)
    capacity = scheduler.kv.num_blocks * scheduler.kv.block_size
    return (scheduler.load_tokens + prefix_weight * (len(token_ids) - hit)) / capacity


def pick_worker(candidates: Sequence[T], token_ids: Sequence[int],
                scheduler_of: Callable[[T], BatchScheduler], prefix_weight: float = 1.0,
                mm_inputs: Sequence[MultiModalInput] = ()) -> T:
    """The candidate of lowest cost (see the module docstring); `candidates` non-empty.
    The request's blocks are hashed once, however many candidates look them up."""
    hashes: dict = {}

    def key(c: T) -> tuple[float, float]:
        scheduler = scheduler_of(c)
        return route_cost(scheduler, token_ids, prefix_weight, mm_inputs, hashes), scheduler.load
    if len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=key)
