"""bench/compute/tune_attention.py's own test: the tuner run end to end on the CPU in Triton's
interpreter (tiny shapes, nothing measured), its scoring, and the merge of its winners into
the tuned-tiles file that kernels/triton_tiles.py reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import triton_tiles
from tests.bench.test_bench_compare import bench_module

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_every_phase_and_layout(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "tune.json"
    subprocess.run([sys.executable, "bench/compute/tune_attention.py", "--smoke", "--json", str(out)], cwd=ROOT,
                   check=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"decode d128-g4", "decode d256-g2", "prefill d128-g4", "prefill d256-g2"}
    for r in result["results"].values():
        assert r["winner"] is not None and r["winner_mean"] == 1.0
        assert all(isinstance(us, float) for c in r["candidates"] for us in c["us"].values())


def test_the_winner_is_the_least_mean_over_each_shapes_best():
    tune = bench_module("compute.tune_attention")
    times = {(16, 32, 4, 2): {"a": 2.0, "b": 1.0},  # the default: 2x, 1x the best
             (16, 64, 4, 2): {"a": 1.0, "b": 1.5},  # 1x, 1.5x: geometric mean 1.22, the least
             (16, 128, 4, 2): {"a": 1.0, "b": "wrong: relative error 1e+00"}}  # dropped
    r = tune.score(times)
    assert r["winner"] == {"BLOCK_M": 16, "TILE_N": 64, "num_warps": 4, "num_stages": 2}
    assert r["winner_mean"] == pytest.approx(1.5 ** 0.5) and r["default_mean"] == pytest.approx(2 ** 0.5)
    assert r["candidates"][2]["mean_over_best"] is None


def test_winners_merge_into_the_file_the_kernels_read(tmp_path):
    tune = bench_module("compute.tune_attention")
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps({"sm_80": {"decode": {"d128-g4": {"BLOCK_M": 16, "TILE_N": 32, "num_warps": 4,
                                                                 "num_stages": 2}}}}))
    winner = {"BLOCK_M": 128, "TILE_N": 32, "num_warps": 8, "num_stages": 3}
    tune.write_tuned(path, "sm_90", {("prefill", "d128-g4"): {"winner": winner},
                                     ("decode", "d256-g2"): {"winner": None}}, {"device": "NVIDIA H200"})
    table = triton_tiles.read_tuned(path)
    assert table[("sm_90", "prefill", "d128-g4")] == (128, 32, 8, 3)
    assert ("sm_80", "decode", "d128-g4") in table and ("sm_90", "decode", "d256-g2") not in table
    assert json.loads(path.read_text())["_measured"]["sm_90"] == {"device": "NVIDIA H200"}
