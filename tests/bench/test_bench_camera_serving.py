""".ci/gpu/camera_serving.py, `make gpu-check`'s cameras step, in its CPU form: the `tiny`
vision preset written config-only and served with `--load-format dummy` by a real stack with
an encoder service and by one without, one camera in each mode, the numbers the step reports."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_cameras_step_runs_every_mode_on_the_cpu(tmp_path):
    out = tmp_path / "cameras.json"
    subprocess.run([sys.executable, str(ROOT / ".ci/gpu/camera_serving.py"), "--device", "cpu", "--duration", "3",
                    "--work", str(tmp_path / "work"), "--json", str(out)], check=True, timeout=600)
    r = json.loads(out.read_text())
    assert (r["preset"], r["load_format"]) == ("tiny", "dummy")
    assert set(r["runs"]) == {"encoder", "worker", "text"}
    for mode, rows in r["runs"].items():
        (row,) = rows
        assert row["cameras"] == 1 and row["questions_failed"] == 0 and row["questions_per_s"] > 0, mode
        assert row["ttft_p90_s"] > 0 and row["output_tokens_per_s"] > 0
    assert r["runs"]["encoder"][0]["encoded_by_encoders"] > 0  # the encoder service encodes the uploads
    assert r["runs"]["worker"][0]["encoded_by_workers"] > 0  # without one, the worker does
    assert r["runs"]["text"][0]["encoded_images_per_s"] == 0
    for mode, (row,) in r["runs"].items():  # kept: nothing failed or skipped, TTFT p90 within 1 s
        kept = not row["questions_skipped"] and row["ttft_p90_s"] <= 1.0
        assert r["largest_k_within_limit"][mode] == (1 if kept else 0), mode
    assert r["physical_limit"]["cameras_per_device"] > 0
