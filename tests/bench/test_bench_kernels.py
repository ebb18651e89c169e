"""bench/compute/kernels.py's own smoke test: the GPU kernel benchmark run end to end on the CPU in
Triton's interpreter (tiny shapes, nothing measured), so a broken script is found here and
not in a GPU lease (`make gpu-check` runs it for real)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_runs_every_case_and_writes_json(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "kernels.json"
    subprocess.run([sys.executable, "bench/compute/kernels.py", "--smoke", "--json", str(out)], cwd=ROOT, check=True,
                   env=dict(os.environ, TRITON_INTERPRET="1"), timeout=600)
    result = json.loads(out.read_text())
    assert result["env"]["device"] == "cpu (smoke test)"
    assert {r["layout"] for r in result["decode"]} == {r["layout"] for r in result["prefill"]} == {
        "llama3-8b", "gemma3-12b"}
    assert {(r["layout"], r["case"]) for r in result["prefill"]} == {
        (layout, case) for layout in ("llama3-8b", "gemma3-12b") for case in ("causal", "images", "images-window")}
    assert all(r["rel_err"] < 2e-2 for r in result["prefill"])
    assert [(r["rows"], r["vocab"]) for r in result["sampling"]] == [(3, 3000)]
    assert [(r["batch"], r["path"]) for r in result["vision"]["rows"]] == [(2, "default")]
