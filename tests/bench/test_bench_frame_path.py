"""bench/cameras/frame_path.py as a smoke test: the real stack on the tiny vision model, a question
with a frame it already holds and one without, and a report whose shape holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_frame_path_smoke(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/cameras/frame_path.py"), "--frames", "2", "--rounds", "2",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["frames"] == 2 and set(report["ttft_ms"]) == {"frames", "text"}
    assert all(v > 0 for v in report["ttft_ms"].values())
    assert "gateway_cpu_ms_per_image_part" in report
