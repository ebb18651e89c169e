"""bench/compute/sampling.py's smoke run: tiny cases on the CPU (the C race against the torch ops),
checking the script and its report, measuring nothing."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_reports_each_case(tmp_path):
    out = tmp_path / "sampling.json"
    subprocess.run([sys.executable, "bench/compute/sampling.py", "--cases", "2x100,3x5000", "--rounds", "1",
                    "--iters", "1", "--json", str(out)], cwd=ROOT, check=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert [(r["rows"], r["vocab"]) for r in report["cases"]] == [(2, 100), (3, 5000)]
    assert all(r["fused_ms"] > 0 and r["torch_ms"] > 0 for r in report["cases"])
