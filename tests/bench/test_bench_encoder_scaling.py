"""bench/cameras/encoder_scaling.py, short: a few frames uploaded to the tiny vision checkpoint's
stack with one encoder and with two; every frame published and encoded exactly once, by
the encoders the run had (a functional check: no timing is asserted)."""

import json

import pytest

from tests.bench.test_bench_compare import bench_module

pytestmark = pytest.mark.e2e


def test_one_round_of_one_and_two_encoders(vision_dir, tmp_path):
    scaling = bench_module("cameras.encoder_scaling")
    out = tmp_path / "scaling.json"
    summary = scaling.main(["--model", str(vision_dir), "--frames", "6", "--rounds", "1", "--width", "160",
                            "--height", "120", "--run-dir", str(tmp_path / "run"), "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(summary))
    assert [r["encoders"] for r in summary["runs"]] == [2, 1]  # round 0 starts with the two the stack has
    for run in summary["runs"]:
        assert run["frames"] == 6 and sum(run["encoded_by"].values()) == 6, run
        assert len(run["encoded_by"]) == run["encoders"] and run["queue_depth_after"] == 0, run
        assert run["frames_per_s"] > 0 and run["upload_s"] > 0, run
    assert set(summary["median_frames_per_s"]) == {1, 2} and summary["ratio_2_over_1"] > 0
