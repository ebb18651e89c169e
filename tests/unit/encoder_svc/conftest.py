"""The encoder service tests' shared fixture: a Redis client on the test Redis (here `client`
is Redis', not tests/conftest.py's openai client on a stack)."""

import pytest
import redis


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()
