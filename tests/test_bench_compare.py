"""bench/compare.py: one interleaved round of the stack and the in-process engine on the
tiny model, and the per-run step / gap reading it takes from each server's /metrics."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from proto.metrics_scrape import parse_samples

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("bench_compare", BENCH / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no bench/ on sys.path: bench/kernels.py must not shadow kernels/
    return module


def page(steps: int, step_sum: float, gaps: int, gap_sum: float) -> str:
    return (f'pagedserve:step_duration_seconds_count{{worker="w"}} {steps}\n'
            f'pagedserve:step_duration_seconds_sum{{worker="w"}} {step_sum}\n'
            f'pagedserve:step_gap_seconds_count{{worker="w"}} {gaps}\n'
            f'pagedserve:step_gap_seconds_sum{{worker="w"}} {gap_sum}\n')


def test_step_split_is_the_difference_of_two_scrapes(compare):
    before = parse_samples(page(10, 1.0, 8, 0.08))
    after = parse_samples(page(30, 3.0, 27, 0.118))
    split = compare.step_split(before, after)
    assert split["steps"] == 20
    assert split["step_mean_s"] == pytest.approx(0.1)
    assert split["gap_mean_s"] == pytest.approx(0.002)
    assert compare.step_split(before, before) == {"steps": 0, "step_mean_s": None, "gap_mean_s": None}


@pytest.mark.e2e
def test_one_round_of_stack_and_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH / "compare.py"), "--model-dir", str(tiny_model_dir),
         "--contenders", "stack", "engine", "--runs", "1", "--concurrency", "4", "--num-requests", "8",
         "--input-mean", "24", "--output-mean", "12", "--threads", "1", "--out-dir", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("stack", "engine"):
        run = json.loads((out / f"{name}-0.json").read_text())
        assert run["num_requests"] == 8 and run["failed"] == 0, name
        steps = run["server_steps"]
        # A request of k output tokens takes k steps (its prompt fits one), and every step
        # samples at least one token: from the longest output (>= 12 / 2) to all of them.
        assert 6 <= steps["steps"] <= run["total_output_tokens"], (name, steps)
        assert steps["step_mean_s"] > 0 and steps["gap_mean_s"] >= 0, (name, steps)
        row = summary["contenders"][name]
        assert row["step_mean_s_median"] == steps["step_mean_s"]
    assert summary["contenders"]["engine"]["stack_over_this_runs"][0] > 0
    assert "| step / gap (mean) |" in done.stdout
    assert done.stdout.count(" ms |") >= 2  # both rows have their step / gap cell
