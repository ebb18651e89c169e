"""bench/stack/token_path.py as a smoke test: the real stack on a tiny model, a few streamed chats,
and a report whose shape holds (every service's CPU counted, every token streamed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def test_token_path_smoke(tmp_path):
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench/stack/token_path.py"), "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    [wave] = report["per_wave"]
    assert wave["tokens"] == 4 * 8 and wave["steps"] >= 8
    assert {"gateway", "worker", "scheduler", "redis", "client"} <= set(report["us_per_token"])
    assert "CPU µs per streamed token" in done.stdout
