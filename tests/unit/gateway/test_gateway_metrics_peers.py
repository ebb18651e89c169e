"""Summing the gateways' own metrics (gateway/gateway_metrics_peers.py): two real
prometheus_client expositions added sample by sample, what one gateway renders with and
without peers, and the records going through a real Redis."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import gateway.app
from gateway.gateway_metrics_peers import PeerGatewayMetrics, sum_expositions
from gateway.metrics import GatewayMetrics
from proto.keys import RedisKeys
from proto.metrics_scrape import parse_samples

from tests.support.gateway_helpers import gateway_client, make_config


def _exposition(requests: dict[str, int], in_flight: int, latencies: list[float]) -> str:
    r = CollectorRegistry()
    counter = Counter("pagedserve_gateway_requests", "HTTP requests answered", ["route", "status"], registry=r)
    for status, n in requests.items():
        counter.labels("/v1/completions", status).inc(n)
    Gauge("pagedserve_gateway_requests_in_flight", "in flight", registry=r).set(in_flight)
    histogram = Histogram("pagedserve:e2e_request_latency_seconds", "e2e", ["model_name"],
                          buckets=(0.1, 1.0), registry=r).labels("m")
    for seconds in latencies:
        histogram.observe(seconds)
    return generate_latest(r).decode()


def _render(families) -> str:
    class Families:
        def collect(self):
            return iter(families)

    r = CollectorRegistry()
    r.register(Families())
    return generate_latest(r).decode()


def test_sum_adds_counters_gauges_and_histograms_by_labels():
    a = _exposition({"200": 3, "400": 1}, in_flight=2, latencies=[0.05, 0.5])
    b = _exposition({"200": 4, "503": 2}, in_flight=1, latencies=[0.05, 5.0, 7.0])
    got = parse_samples(_render(sum_expositions([a, b])))
    route = ("route", "/v1/completions")
    assert got[("pagedserve_gateway_requests_total", (route, ("status", "200")))] == 7
    assert got[("pagedserve_gateway_requests_total", (route, ("status", "400")))] == 1
    assert got[("pagedserve_gateway_requests_total", (route, ("status", "503")))] == 2
    assert got[("pagedserve_gateway_requests_in_flight", ())] == 3
    m = ("model_name", "m")
    assert got[("pagedserve:e2e_request_latency_seconds_bucket", (("le", "0.1"), m))] == 2
    assert got[("pagedserve:e2e_request_latency_seconds_bucket", (("le", "1.0"), m))] == 3
    assert got[("pagedserve:e2e_request_latency_seconds_bucket", (("le", "+Inf"), m))] == 5
    assert got[("pagedserve:e2e_request_latency_seconds_count", (m,))] == 5
    assert abs(got[("pagedserve:e2e_request_latency_seconds_sum", (m,))] - 12.6) < 1e-9
    # creation times are not added up: the earliest stays
    created = ("pagedserve_gateway_requests_created", (route, ("status", "200")))
    assert got[created] == min(parse_samples(a)[created], parse_samples(b)[created])


def test_sum_of_one_exposition_renders_it_unchanged():
    a = _exposition({"200": 3}, in_flight=1, latencies=[0.5])
    assert parse_samples(_render(sum_expositions([a]))) == parse_samples(a)
    assert _render(sum_expositions([a])) == a


def test_gateway_response_sums_peers_and_renders_the_stack_once():
    metrics = GatewayMetrics("m")
    metrics.success.labels("m", "stop").inc(2)
    alone = parse_samples(metrics.response().body.decode())
    assert alone == parse_samples(metrics.own_exposition() + generate_latest(metrics.stack_registry).decode())
    peer = GatewayMetrics("m")
    peer.success.labels("m", "stop").inc(3)
    peer.success.labels("m", "length").inc(1)
    peer.tokens.generation_tokens = 9
    text = metrics.response([peer.own_exposition()]).body.decode()
    got = parse_samples(text)
    m = ("model_name", "m")
    assert got[("pagedserve:request_success_total", (("finished_reason", "stop"), m))] == 5
    assert got[("pagedserve:request_success_total", (("finished_reason", "length"), m))] == 1
    assert got[("pagedserve:generation_tokens_total", (m,))] == 9
    assert set(got) == set(alone) | {("pagedserve:request_success_total", (("finished_reason", "length"), m)),
                                     ("pagedserve:request_success_created", (("finished_reason", "length"), m))}
    assert text.count("# TYPE pagedserve:request_success_total counter") == 1


def test_records_go_through_redis(redis_url):
    keys = RedisKeys(f"test-{uuid.uuid4().hex[:8]}")

    async def run():
        client = aioredis.Redis.from_url(redis_url)
        try:
            one, two = (PeerGatewayMetrics(client, keys, gateway_id) for gateway_id in ("g1", "g2"))
            assert await one.peers() == []
            await one.publish("one's text")
            await two.publish("two's text")
            assert [(r.gateway_id, r.text) for r in await one.peers()] == [("g2", "two's text")]
            assert [r.gateway_id for r in await two.peers()] == ["g1"]
            assert 0 < await client.ttl(keys.gateway_metrics("g1")) <= 5
            await client.delete(keys.gateway_metrics("g2"))  # as if its TTL ran out
            assert await one.peers() == []
            assert await client.smembers(keys.gateways) == {b"g1"}  # the expired one left the set
            await one.withdraw()
            assert await two.peers() == [] and not await client.exists(keys.gateways)
        finally:
            await client.aclose()

    asyncio.run(run())


@pytest.mark.anyio
async def test_the_publisher_ends_with_the_app(tiny_model_dir, redis_url, monkeypatch):
    # Publishing back to back, the lifespan's cancel lands inside redis-py's pipeline, which
    # swallows it: the publisher must stop on its event, or it outlives the app and hangs
    # the runner that later cancels and awaits it (gateway_client asserts none is left).
    monkeypatch.setattr(gateway.app, "PUBLISH_INTERVAL_S", 0.0005)
    for _ in range(4):
        async with gateway_client(make_config(tiny_model_dir, redis_url)):
            await asyncio.sleep(0.01)
