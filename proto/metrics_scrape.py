"""Reading a /metrics page back: every sample by (name, labels), and sums over labels.

    samples = scrape("http://127.0.0.1:8000/metrics")
    steps = metric(samples, "pagedserve:step_duration_seconds_count")          # every worker
    gaps = metric(samples, "pagedserve:step_gap_seconds_sum", worker="worker-0")

Used by the benchmarks (bench/stack/compare.py reads the step and gap histograms of each run) and
the tests that check what the services export. Parsing goes through prometheus_client's own
parser, so a page that is not valid exposition text fails here.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse_samples(text: str) -> Samples:
    """Every sample of a Prometheus exposition by (name, sorted labels)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(url: str, timeout_s: float = 10.0) -> Samples:
    """A /metrics page's samples (parse_samples)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return parse_samples(reply.read().decode())


def metric(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())
