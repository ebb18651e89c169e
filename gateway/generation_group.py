"""Several Generations answered as one: a /v1/completions request with a list of prompts.

Each prompt is its own NewRequest (its own prompt, blocks and prefix-cache lookup); their
choices are numbered prompt-major, as OpenAI does: choice `i * n + j` is prompt i's j-th.
Outputs interleave in arrival order; the first error ends the whole answer and closing the
group closes (aborts) every member.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from gateway.generation import GenerationOutput

_DONE = object()


class Generating(Protocol):
    """What serving needs of a generation (Generation, MeteredGeneration, GenerationGroup)."""

    @property
    def request_id(self) -> str: ...

    @property
    def n(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...  # prompt tokens from the prefix cache, so far

    def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]: ...

    def close(self) -> None: ...


class GenerationGroup:
    def __init__(self, request_id: str, members: Sequence[Generating]):
        self._request_id = request_id
        self._members = list(members)
        self._offsets = [sum(m.n for m in self._members[:i]) for i in range(len(self._members))]

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def n(self) -> int:
        return sum(m.n for m in self._members)

    @property
    def num_cached_tokens(self) -> int:
        """Every prompt's, summed as its prompt tokens are (usage)."""
        return sum(m.num_cached_tokens for m in self._members)

    async def outputs(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        # Bounded: a consumer that stops (its client stopped reading) stops the members from
        # reading their events, so their own bounded queues fill and give up (event_queues.py).
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(self._members))

        async def pump(member: Generating, offset: int) -> None:
            try:
                async for index, output in member.outputs():
                    await queue.put((offset + index, output))
                await queue.put(_DONE)
            except Exception as exc:  # handed to the consumer, which raises it
                await queue.put(exc)

        tasks = [asyncio.ensure_future(pump(m, o)) for m, o in zip(self._members, self._offsets)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _DONE:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        for member in self._members:
            member.close()
