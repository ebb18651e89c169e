"""bench/cameras/camera_limits.py: the windows' key counts against a brute-force count, and the
limits of Gemma 3 12B's camera workload on the H200's rates from a `--config-only` folder
(what docs/benchmarks.md quotes)."""

import json
import subprocess
import sys
from types import SimpleNamespace

from tests.bench.test_bench_compare import BENCH, bench_module
from tools.make_model import make_model


def test_attended_keys_cap_sliding_layers_at_their_window():
    cl = bench_module("cameras.camera_limits")
    cfg = SimpleNamespace(sliding_windows=(None, 3))
    brute = sum(p + 1 for p in range(5)) + sum(min(p + 1, 3) for p in range(5))
    assert cl.attended_keys(cfg, 0, 5) == brute == 27
    assert cl.attended_keys(cfg, 4, 1) == 5 + 3  # one decode query after 4 tokens
    assert cl.kv_tokens(cfg, 10) == 10 + 3


def test_gemma_3_12b_on_an_h200(tmp_path):
    model = make_model(tmp_path / "gemma-3-12b-it", preset="gemma-3-12b-it", arch="gemma3-vision",
                       config_only=True)
    out = tmp_path / "limits.json"
    subprocess.run([sys.executable, str(BENCH / "cameras" / "camera_limits.py"), "--model-dir", str(model),
                    "--json", str(out)], check=True, timeout=300)
    r = json.loads(out.read_text())
    assert r["prompt_tokens"] == 8 * (256 + 12) + 30
    assert 47 < r["prefill_TFLOP_per_question"] < 49  # ../shared/GPU-NOTES.md: ~47.7 at 2,150 tokens
    assert round(r["siglip_TFLOP_per_frame"], 2) == 5.46
    assert 24 < r["weights_GB"] < 25
    assert (r["cameras_per_device"], r["bound"], r["cameras_not_overlapped"]) == (13, "compute", 11)
