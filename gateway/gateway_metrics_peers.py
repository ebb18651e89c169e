"""The metrics of every live gateway, summed, so that any one gateway's /metrics shows them.

Several gateway processes may serve one stack (`pagedserve up --gateways N`: one port,
SO_REUSEPORT). A scrape reaches one of them, yet the dashboards want the stack's totals, so
each gateway publishes its own metrics (its exposition text, a `GatewayMetricsRecord`) under
`RedisKeys.gateway_metrics(gateway_id)` with a short TTL, about every second and before each
scrape it answers; its id joins the set `RedisKeys.gateways`. A scrape then reads every live
peer's record (one SMEMBERS, one MGET; ids whose record expired are dropped from the set)
and `sum_expositions` adds them to the answering gateway's own, taken live: sample by
sample, keyed by (sample name, labels), so counters, gauges and histogram buckets, sums and
counts all add up. `_created` samples keep the earliest. A gateway that stops removes its
record, so the sums lose what it counted (Prometheus reads that as a counter reset).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import msgspec
import redis.asyncio as aioredis
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from proto.keys import RedisKeys
from proto.live_set import LiveSet

PUBLISH_INTERVAL_S = 1.0
RECORD_TTL_S = 5  # a few missed publishes before a live gateway's numbers drop out


class GatewayMetricsRecord(msgspec.Struct, frozen=True):
    """One gateway's own metrics as Prometheus text (format 0.0.4), as of `updated_at` (unix s)."""
    gateway_id: str
    text: str
    updated_at: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(GatewayMetricsRecord)


class PeerGatewayMetrics:
    """Publishes this gateway's record and reads the other live gateways' ones."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, gateway_id: str) -> None:
        self.client = client
        self.keys = keys
        self.gateway_id = gateway_id

    async def publish(self, text: str) -> None:
        record = GatewayMetricsRecord(self.gateway_id, text, time.time())
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.gateway_metrics(self.gateway_id), _encoder.encode(record), ex=RECORD_TTL_S)
            pipe.sadd(self.keys.gateways, self.gateway_id)
            await pipe.execute()

    async def withdraw(self) -> None:
        """This gateway stops: its numbers leave the sums now rather than at the TTL."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.gateway_metrics(self.gateway_id))
            pipe.srem(self.keys.gateways, self.gateway_id)
            await pipe.execute()

    async def peers(self) -> list[GatewayMetricsRecord]:
        """The records of the other live gateways (not this one's: the caller has it live)."""
        return await LiveSet(self.keys.gateways, self.keys.gateway_metrics, _decoder, "gateway").read(
            self.client, exclude={self.gateway_id})


def sum_expositions(texts: Sequence[str]) -> list[Metric]:
    """The metric families of `texts` (Prometheus text expositions), summed sample by sample:
    a sample's value is the sum of the samples of that name and labels in every text
    (`_created` ones: the earliest). Families and samples keep the order they first appear in."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                values[family.name] = {}
            summed = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                if key not in summed:
                    summed[key] = sample.value
                elif sample.name.endswith("_created"):
                    summed[key] = min(summed[key], sample.value)
                else:
                    summed[key] += sample.value
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    return list(families.values())


class SummedCollector:
    """Renders the families one scrape summed (`sum_expositions`), for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
