"""Encoder work in the step plan: which image embeddings a worker holds, as its scheduler
can tell, and how many images one step may make its worker encode.

    mirror = EncoderCacheMirror(info.encoder_cache_items)   one per worker (BatchScheduler)
    mirror.holds(hash)                whether the worker's encoder cache should hold it now
    mirror.note_published(hashes)     the encoder service has published them (the scheduler
                                      looked when it routed the request): ready, not encoded
    mirror.touch_step(chunks)         the images of a planned step's chunks, in step order:
                                      the worker gets or puts each one (its cache is LRU)
    budget = StepEncoderBudget(limit, mirror)               one per planned step
    num_new = budget.fit(req, start, num_new)  the chunk ended before the first image it
                                      cannot afford (0: not this step)

The mirror replays what the worker's cache (vision/encoder_cache.py) does: every image
of a step is used there (a hit, published, or encoded and put), most recent last, the least
recently used out beyond `capacity_items` (WorkerInfo.encoder_cache_items: entries are all
the same size), by the images' `embedding_key` (the worker's cache key: a pan-and-scan
crop is an entry of its own). It can be wrong -- a worker restarted, an entry failed -- and then costs a
budget unit or a routing preference, never a wrong output: the worker still decides what it
has. The scheduler uses it twice:

  budget   `--encoder-budget N` (0: no bound; auto, the default: 2 for a CPU worker, no
           bound on an accelerator): a step makes its worker encode at most N
           images (or video frames, or pan-and-scan crops) it does not hold and the encoder service has not
           published (the worker only reads those), so a burst of new images is spread
           over several steps and the decodes batched beside them keep their pace (vLLM's
           encoder budget, counted in images: a Gemma 3 image is mm_tokens_per_image
           tokens either way). An image is never split (scheduler_svc/policy/planner.py): a chunk
           that cannot afford its next image ends at that image's start.
  routing  an image the worker holds counts as hit tokens (scheduler_svc/policy/routing.py): a
           camera's next question goes where its last frames are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from proto.messages import MultiModalInput
from scheduler_svc.policy.request import SchedulerRequest

CPU_ENCODER_BUDGET = 2  # --encoder-budget auto on a CPU worker (docs/benchmarks.md, "The encoder budget")


def resolve_encoder_budget(budget: int | None, device: str) -> int:
    """--encoder-budget for a worker on `device` (WorkerInfo.device): as given, or for auto
    (None) CPU_ENCODER_BUDGET on the CPU -- an image costs its step about as much as
    hundreds of tokens there -- and no bound (0) on an accelerator."""
    if budget is not None:
        return budget
    return CPU_ENCODER_BUDGET if device in ("", "cpu") else 0


class EncoderCacheMirror:
    def __init__(self, capacity_items: int, published_items: int = 4096):
        self.capacity_items = max(0, capacity_items)
        self._held: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._published: OrderedDict[str, None] = OrderedDict()  # the last `published_items` seen
        self._published_items = published_items

    def __len__(self) -> int:
        return len(self._held)

    def holds(self, content_hash: str) -> bool:
        return content_hash in self._held

    def ready(self, content_hash: str) -> bool:
        """Held, or published by the encoder service: the worker encodes nothing for it."""
        return content_hash in self._held or content_hash in self._published

    def note_published(self, hashes: Iterable[str]) -> None:
        for h in hashes:
            self._published[h] = None
            self._published.move_to_end(h)
        while len(self._published) > self._published_items:
            self._published.popitem(last=False)

    def held_tokens(self, mm_inputs: Sequence[MultiModalInput], start: int = 0) -> int:
        """Soft tokens of the images at or after prompt position `start` that it holds."""
        return sum(m.length for m in mm_inputs if m.offset >= start and m.embedding_key in self._held)

    def touch(self, hashes: Iterable[str]) -> None:
        if not self.capacity_items:
            return
        for h in hashes:
            self._held[h] = None
            self._held.move_to_end(h)
        while len(self._held) > self.capacity_items:
            self._held.popitem(last=False)

    def touch_step(self, chunks: Iterable[tuple[SchedulerRequest, int]]) -> None:
        """(request, tokens computed from its num_computed_tokens) of a planned step."""
        for req, num_new in chunks:
            if req.num_computed_tokens < req.images_end:
                self.touch(images_in(req, req.num_computed_tokens, num_new))


def images_in(req: SchedulerRequest, start: int, num_new: int) -> list[str]:
    """Embedding keys of the images starting in the chunk [start, start + num_new)."""
    end = start + num_new
    return [m.embedding_key for m in req.mm_inputs if start <= m.offset < end]


class StepEncoderBudget:
    """The images one step may still make its worker encode."""

    def __init__(self, limit: int, mirror: EncoderCacheMirror):
        self._left = limit
        self._mirror = mirror
        self._counted: set[str] = set()  # this step's images to encode (each once)

    def fit(self, req: SchedulerRequest, start: int, num_new: int) -> int:
        """The chunk [start, start + num_new) (fitted to its images already) cut at the
        start of the first image it cannot afford; the images it keeps are counted."""
        for image in req.mm_inputs:
            if image.offset < start:
                continue
            if image.offset >= start + num_new:
                break
            h = image.embedding_key
            if h in self._counted or self._mirror.ready(h):
                continue
            if self._left <= 0:
                return image.offset - start
            self._left -= 1
            self._counted.add(h)
        return num_new
