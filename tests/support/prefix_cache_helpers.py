"""What the prefix-cache tests (test_prefix_cache.py, test_prefix_cache_scheduler.py) and
the routing tests (test_routing.py) share: the block size, a prompt of three full blocks, a
greedy request with a prompt of its own, and a hash function that collides on purpose."""

from kvstore.block_hash import hash_block
from proto.messages import NewRequest, SamplingParams

BS = 4
P = list(range(100, 112))  # three blocks of 4


def request(rid: str, prompt: list[int], max_tokens: int, arrival: float, **sampling):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return NewRequest(rid, prompt, params, "out:gw", arrival)


def colliding_hash(parent: bytes, tokens, extra_keys) -> bytes:
    """Ignores the parent: the same tokens collide at every position and after any prefix."""
    return hash_block(b"", tokens, extra_keys)
