"""bench/compute/cpu_attention.py: one short interleaved run of this tree's kernel against itself at
HEAD (skipped outside a git checkout, which has no revision to build)."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.bench.test_bench_compare import bench_module

ROOT = Path(__file__).resolve().parents[2]


def test_one_short_run(capsys):
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout: no baseline revision to build")
    assert bench_module("compute.cpu_attention").main(
        ["--baseline", "HEAD", "--batch", "4", "--context", "40", "--pool-blocks", "64", "--layers", "2",
         "--calls", "2", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"{dtype}: this tree [\d.]+ ms, baseline [\d.]+ ms, ratio [\d.]+ \(rounds "
                         r"[\d., ]+\); largest output difference", out), out


def test_a_pool_too_small_for_the_batch_is_refused():
    with pytest.raises(SystemExit):
        bench_module("compute.cpu_attention").main(["--baseline", "HEAD", "--batch", "8", "--pool-blocks", "4"])
