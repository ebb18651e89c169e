"""bench/compute/mixed_step.py on the tiny model: a chunk computed in one step beside the decodes,
its floor below the sum of its parts' floors (the weights are read once), and its JSON."""

import json

import pytest

from tests.bench.test_bench_compare import bench_module


def test_a_mixed_step_against_its_parts(tiny_model_dir, tmp_path):
    mixed = bench_module("compute.mixed_step")
    out = tmp_path / "mixed.json"
    assert mixed.main(["--model-dir", str(tiny_model_dir), "--batch", "3", "--context", "24", "--chunk", "40",
                       "--rounds", "2", "--threads", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["batch"], r["chunk"], r["rounds"]) == (3, 40, 2)
    assert (r["decodes_in_step"], r["chunk_tokens_in_step"]) == (3, 40)  # the step timed holds both parts
    assert 0 < r["floor_ms"] < r["parts_floor_ms"]
    assert r["over_floor"] == pytest.approx(r["mixed_step_ms"] / r["floor_ms"])
    assert r["over_parts_measured"] == pytest.approx(r["mixed_step_ms"] / (r["decode_step_ms"] + r["chunk_alone_ms"]))
