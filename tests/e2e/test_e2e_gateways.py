"""Two gateway processes on one port (`pagedserve up --gateways 2`: SO_REUSEPORT), real
processes through the launcher: requests on separate connections land on both, and every
scrape of /metrics, whichever gateway answers it, counts all of them."""

from __future__ import annotations

import time
import urllib.request

import httpx
import msgspec
import redis

from gateway.gateway_metrics_peers import PUBLISH_INTERVAL_S, GatewayMetricsRecord
from proto.metrics_scrape import metric, parse_samples, scrape
from tests.support.stack_helpers import running_stack

REQUESTS = 24  # over new connections: all on one of 2 gateways with probability 2^-23


def test_two_gateways_share_the_port_and_sum_their_metrics(tiny_model_dir, redis_url, tmp_path):
    with running_stack(tiny_model_dir, redis_url, tmp_path / "run", gateways=2) as stack:
        assert {"gateway", "gateway-1"} <= set(stack.procs)
        assert len(stack.live_gateway_ids()) == 2
        for i in range(REQUESTS):
            with httpx.Client(base_url=stack.base_url, timeout=30) as client:  # a new connection each
                reply = client.post("/completions", json={"model": stack.served_model_name, "prompt": f"{i} apples",
                                                          "max_tokens": 3, "ignore_eos": True})
                assert reply.status_code == 200, reply.text
        name = "pagedserve:request_success_total"
        deadline = time.monotonic() + 15
        while metric(scrape(stack.metrics_urls["gateway"]), name) != REQUESTS:
            assert time.monotonic() < deadline, "the gateways' sum never reached every request"
            time.sleep(0.2)
        time.sleep(2 * PUBLISH_INTERVAL_S)  # both records are current now
        for _ in range(8):  # new connections: both gateways answer some of these
            request = urllib.request.Request(stack.metrics_urls["gateway"], headers={"Connection": "close"})
            with urllib.request.urlopen(request, timeout=10) as reply:
                samples = parse_samples(reply.read().decode())
            assert metric(samples, name) == REQUESTS
            assert metric(samples, "pagedserve_gateway_requests_total", route="/v1/completions") == REQUESTS
        # each gateway's own record: both served some, and together all
        client = redis.Redis.from_url(stack.redis_url)
        records = [msgspec.msgpack.decode(client.get(stack.keys.gateway_metrics(i)), type=GatewayMetricsRecord)
                   for i in stack.live_gateway_ids()]
        served = [metric(parse_samples(r.text), name) for r in records]
        assert len(served) == 2 and all(n > 0 for n in served) and sum(served) == REQUESTS
