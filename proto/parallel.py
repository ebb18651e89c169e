"""Parallel sampling (`NewRequest.n > 1`): how the n sequences of one request are named and
seeded. One rule for every side -- the gateway maps token events to choices and aborts one
choice with these ids, the scheduler forks children under them.

A request's own id never contains SEPARATOR (the scheduler rejects one that does); sequence
i of a request with n > 1 is `f"{request_id}/{i}"` and samples with `child_seed(seed, i)`.
A request with n == 1 is its own only sequence, under its own id. A sampled request that
brings no seed samples with `request_seed(request_id)`, so every request's draws are fixed
by what it is (worker_svc/sampler.py draws from (seed, position)).
"""

import hashlib

SEPARATOR = "/"
_U64 = 2**64


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}{SEPARATOR}{index}"


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids the token events of a request with `n` sequences carry, by sequence index."""
    return [request_id] if n == 1 else [child_request_id(request_id, i) for i in range(n)]


def parent_request_id(request_id: str) -> str | None:
    """The parent of a child id (`p/1` -> `p`); None for a request's own id."""
    parent, separator, _ = request_id.rpartition(SEPARATOR)
    return parent if separator else None


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of sequence `index`: seed + index, wrapped into int64 (protobuf's `seed`), so
    sequence 0 samples like the request with n == 1 and every sequence has its own stream."""
    if seed is None or index == 0:
        return seed
    value = (seed + index) % _U64
    return value - _U64 if value >= 2**63 else value


def request_seed(request_id: str) -> int:
    """The seed of a request that brought none: from its id (unique, and the same after a
    scheduler restart re-reads it), so a position re-sampled on another worker after a
    crash draws the token the client already has."""
    value = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")
    return value - _U64 if value >= 2**63 else value
