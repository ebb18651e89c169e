"""bench/compute/step_round_trip.py: one short round of every mode against its stand-in worker."""

from tests.bench.test_bench_compare import bench_module


def test_one_short_round(capsys):
    report = bench_module("compute.step_round_trip").main(["--streams", "2", "--steps", "20", "--rounds", "1"])
    costs = report["us_per_round_trip"]
    assert set(costs) == {"aio", "thread", "loop"}, report
    assert all(cost > 0 for cost in costs.values()), report
    assert "aio     median" in capsys.readouterr().out
