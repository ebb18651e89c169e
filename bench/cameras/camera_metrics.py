"""bench/cameras/cameras.py's server side: the /metrics pages it reads before and after a run (the
gateway's, each vision worker's, each encoder service's), and what grew in between.

    before = settle(urls)                      # once the pages stand still
    ... the run ...
    after = settle(urls)                       # and again, every encoder's queue empty
    server = server_counters(before, after)    # {"encoded": 336.0, "encoded_by_encoders": ...}

A counter is summed over its series, each series counted once however many pages show it:
the gateway's /metrics shows every worker's and encoder's image counters too (issue 46), so
the gateway's page alone is enough, and a series also read from its own process's page is
taken from the freshest of them (the largest value: the gateway's copy may be a second
behind). None where no page exports it. The vision counters the workers and the encoder
services share (`mm_items_encoded_total`, `encoder_seconds`) are also split by their label:
`worker="..."` (a worker's own encoding, on the question's path) or `encoder="..."`
(`pagedserve encoder`, ahead of the question).
"""

from __future__ import annotations

import time

from proto.metrics_scrape import Samples, metric, scrape

COUNTERS = {  # what the summary calls it → the metric, summed over every page and label
    "received": "pagedserve:mm_images_received_total",  # gateway: fetched, decoded, checked
    "stored": "pagedserve:mm_items_stored_total", "reused": "pagedserve:mm_items_reused_total",
    "stored_bytes": "pagedserve:mm_stored_bytes_total", "by_uuid": "pagedserve:mm_media_by_uuid_total",
    "encoded": "pagedserve:mm_items_encoded_total",  # workers and encoder services together
    "mm_queries": "pagedserve:mm_cache_queries_total",  # worker: distinct frames steps needed
    "mm_ready": "pagedserve:mm_cache_hits_total",  # ... ready: in its encoder cache, or published
    "cache_hits": "pagedserve:encoder_cache_hits_total",  # ... in its own encoder cache
    "published": "pagedserve:mm_embeddings_published_total",  # encoder service
    "found_published": "pagedserve:mm_embeddings_found_total",
    "encode_failed": "pagedserve:mm_encode_failed_total"}
LABELLED = {  # → (the metric, the label its samples carry): summed over those samples only
    "encoded_by_workers": ("pagedserve:mm_items_encoded_total", "worker"),
    "encoded_by_encoders": ("pagedserve:mm_items_encoded_total", "encoder"),
    "encoder_s": ("pagedserve:encoder_seconds_sum", "worker"),  # the workers' encoding, busy seconds
    "encoder_steps": ("pagedserve:encoder_seconds_count", "worker"),
    "encoders_s": ("pagedserve:encoder_seconds_sum", "encoder"),  # the encoder services', busy seconds
    "encoders_batches": ("pagedserve:encoder_seconds_count", "encoder")}
# longer than the scheduler's --stats-interval-s (1 s), after which the gateway's copy of a
# worker's counters is fresh
QUIET_S = 1.2
QUEUE_DEPTH = "pagedserve:encoder_queue_depth"  # a gauge: encode jobs not finished (the same stream on every encoder)


def scrape_all(urls: list[str]) -> list[Samples]:
    return [scrape(url) for url in urls]


def labelled(samples: Samples, name: str, label: str) -> float | None:
    """The sum of `name`'s samples that carry the label `label` (any value); None if none does."""
    values = [v for (n, labels), v in samples.items() if n == name and any(k == label for k, _ in labels)]
    return sum(values) if values else None


def merged(pages: list[Samples]) -> Samples:
    """Every series of `pages` once: a series several pages show (the gateway's copy of a
    worker's counter and the worker's own) at its largest value, the freshest."""
    out: Samples = {}
    for page in pages:
        for key, value in page.items():
            out[key] = max(value, out.get(key, value))
    return out


def server_counters(before: list[Samples], after: list[Samples]) -> dict[str, float | None]:
    """Each counter's growth, summed over its series (`merged`); None where no page exports
    it. `encoder_queue_depth`: the encode jobs still unfinished after (the most any page says)."""
    b, a = merged(before), merged(after)
    out: dict[str, float | None] = {}
    for key, name in COUNTERS.items():
        out[key] = metric(a, name) - metric(b, name) if any(n == name for n, _ in a) else None
    for key, (name, label) in LABELLED.items():
        grown = labelled(a, name, label)
        out[key] = grown - (labelled(b, name, label) or 0.0) if grown is not None else None
    depths = [metric(a, QUEUE_DEPTH) for a in after if any(n == QUEUE_DEPTH for n, _ in a)]
    out["encoder_queue_depth"] = max(depths) if depths else None
    return out


def settle(urls: list[str], timeout_s: float = 30.0, quiet_s: float = QUIET_S) -> list[Samples]:
    """The pages once they stand still: no encoder service among them has an encode job left
    (it may still be encoding frames uploaded for a question that was skipped), and none of
    the counters read moved over `quiet_s` (the gateway shows the workers' counters as the
    scheduler last wrote them, once a second: what a scrape right after a question shows
    may miss its frames); or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        pages = scrape_all(urls)
        now = _read(pages)
        if (all(metric(p, QUEUE_DEPTH) == 0 for p in pages) and now == last) or time.monotonic() > deadline:
            return pages
        last = now
        time.sleep(quiet_s)


def _read(pages: list[Samples]) -> Samples:
    """The series of the counters `server_counters` reads."""
    names = set(COUNTERS.values()) | {name for name, _ in LABELLED.values()}
    return {key: value for key, value in merged(pages).items() if key[0] in names}
