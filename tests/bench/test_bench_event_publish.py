"""bench/compute/event_publish.py: one short interleaved run against a real redis-server, this
tree's EventPublisher against itself at HEAD when this is a git checkout."""

import re
import subprocess
from pathlib import Path

from tests.bench.test_bench_compare import bench_module

ROOT = Path(__file__).resolve().parents[2]


def test_one_short_run(redis_url, capsys):
    in_git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0
    baseline = ["--baseline", "HEAD"] if in_git else []
    assert bench_module("compute.event_publish").main(
        ["--redis-url", redis_url, "--steps", "20", "--rounds", "2", "--batch", "4", *baseline]) == 0
    out = capsys.readouterr().out
    assert re.search(r"public pipeline \(this tree\) +median +[\d.]+ us", out), out
    if in_git:
        assert "baseline (HEAD)" in out and "this tree minus the baseline" in out
