"""bench/compute/step_round_trip.py: one short round of every mode against its stand-in worker,
and a broken stream failing a measurement at once instead of hanging it."""

import asyncio

import grpc
import pytest

from compose.launcher import free_port
from tests.bench.test_bench_compare import bench_module


def test_one_short_round(capsys):
    report = bench_module("compute.step_round_trip").main(["--streams", "2", "--steps", "20", "--rounds", "1"])
    costs = report["us_per_round_trip"]
    assert set(costs) == {"aio", "thread", "tcp", "loop"}, report
    assert all(cost > 0 for cost in costs.values()), report
    assert "aio     median" in capsys.readouterr().out


@pytest.mark.parametrize("mode, error", [("aio", grpc.aio.AioRpcError), ("thread", RuntimeError),
                                         ("tcp", ConnectionRefusedError)])
def test_a_stream_with_no_worker_fails_the_measurement(mode, error):
    measure = bench_module("compute.step_round_trip").measure
    with pytest.raises(error):
        asyncio.run(asyncio.wait_for(measure(mode, free_port(), streams=2, steps=5, seqs=2, pause_s=0), 30))
