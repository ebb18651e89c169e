"""Rendezvous (highest-random-weight) hashing: a stable order of some items for a given
salt. Every process that ranks the same items under the same salt gets the same order, and
an item that comes or goes moves no other item's place: scheduler shards' preferences for
workers, schedulers' for shards, and the gateways' shard for a prompt prefix."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def rendezvous_order(salt: bytes, items: Iterable[T]) -> list[T]:
    """`items` sorted by an 8-byte blake2b digest of `salt` followed by `str(item)`."""
    return sorted(items, key=lambda item: hashlib.blake2b(salt + str(item).encode(), digest_size=8).digest())
