"""gateway/generation_group.py: several prompts' Generations answered as one. Its queue is
bounded, so a consumer that stops (a client that stopped reading) stops the members from
taking their events: their own bounded queues then fill and give up (event_queues.py)."""

from __future__ import annotations

import asyncio

from gateway.generation import GenerationOutput
from gateway.generation_group import GenerationGroup


class CountingMember:
    """A member with endless outputs that counts how many were taken from it."""

    def __init__(self, request_id: str):
        self.request_id, self.n, self.num_cached_tokens = request_id, 1, 0
        self.taken = 0
        self.closed = False

    async def outputs(self):
        while True:
            self.taken += 1
            yield 0, GenerationOutput("x", [1], self.taken, None)
            await asyncio.sleep(0)

    def close(self):
        self.closed = True


def test_a_stopped_consumer_stops_the_members():
    async def scenario():
        members = [CountingMember("a"), CountingMember("b")]
        group = GenerationGroup("g", members)
        outputs = group.outputs()
        seen = [await outputs.__anext__() for _ in range(5)]
        assert {index for index, _ in seen} <= {0, 1}
        for _ in range(200):  # the consumer waits: the pumps may run
            await asyncio.sleep(0)
        taken = sum(m.taken for m in members)
        assert taken <= 5 + len(members) + len(members), taken  # what was read, the queue, one in hand each
        await outputs.aclose()
        group.close()
        assert all(m.closed for m in members)

    asyncio.run(scenario())
