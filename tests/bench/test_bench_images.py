"""bench/cameras/images.py: image requests against the stack on the tiny gemma3-vision checkpoint,
end to end, and the pieces it is made of (the frames, the worker's encoder reading)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from proto.metrics_scrape import parse_samples
from tests.bench.test_bench_compare import BENCH, bench_module


@pytest.fixture(scope="module")
def images():
    return bench_module("cameras.images")


@pytest.fixture(scope="module")
def workloads():
    return bench_module("common.workloads")


def test_frames_are_deterministic_distinct_jpegs_of_the_asked_size(workloads):
    spec = workloads.ImageSpec(num_requests=3, images_per_request=2, width=64, height=48, output_tokens=5, seed=7)
    first, again = workloads.make_image_workload(spec), workloads.make_image_workload(spec)
    assert first == again and len(first) == 3
    frames = [b for r in first for b in r.images]
    assert len(set(frames)) == 6  # no frame repeats: no encoder-cache hit inside a run
    image = Image.open(io.BytesIO(frames[0]))
    assert image.format == "JPEG" and image.size == (64, 48)
    assert all(r.max_tokens == 5 for r in first) and len({r.text for r in first}) == 3
    other = workloads.make_image_workload(workloads.ImageSpec(num_requests=3, images_per_request=2, width=64,
                                                              height=48, seed=8))
    assert not set(frames) & {b for r in other for b in r.images}


def worker_page(steps: int, step_sum: float, encodes: int, encoder_sum: float, images: int) -> str:
    return (f'pagedserve:step_duration_seconds_count{{worker="w"}} {steps}\n'
            f'pagedserve:step_duration_seconds_sum{{worker="w"}} {step_sum}\n'
            f'pagedserve:encoder_seconds_count{{worker="w"}} {encodes}\n'
            f'pagedserve:encoder_seconds_sum{{worker="w"}} {encoder_sum}\n'
            f'pagedserve:mm_items_encoded_total{{worker="w"}} {images}\n')


def test_encoder_share_is_the_difference_of_two_scrapes(images):
    before = parse_samples(worker_page(10, 1.0, 2, 0.2, 4))
    after = parse_samples(worker_page(30, 5.0, 5, 1.2, 12))
    split = images.encoder_split(before, after)
    assert split["steps"] == 20 and split["encoder_steps"] == 3 and split["images_encoded"] == 8
    assert split["step_s"] == pytest.approx(4.0) and split["encoder_s"] == pytest.approx(1.0)
    assert split["encoder_share"] == pytest.approx(0.25) and split["encoder_s_per_image"] == pytest.approx(0.125)
    text_only = parse_samples('pagedserve:step_duration_seconds_count{worker="w"} 3\n')
    assert "encoder_share" not in images.encoder_split(text_only, text_only)  # not exported: not a 0% share


def test_the_worker_metrics_url_comes_from_what_up_prints(images, tmp_path):
    log = tmp_path / "stack.log"
    log.write_text("metrics: gateway http://127.0.0.1:1/metrics, worker-0 http://127.0.0.1:2/metrics\n"
                   "pagedserve: serving m on http://127.0.0.1:3/v1\n"
                   "metrics: gateway http://127.0.0.1:3/metrics, worker-0 http://127.0.0.1:4/metrics, "
                   "scheduler http://127.0.0.1:5/metrics\n")
    offset = len(log.read_bytes().split(b"\n", 1)[0]) + 1  # an earlier round's line is not this one
    assert images.worker_metrics_url(log, offset) == "http://127.0.0.1:4/metrics"


@pytest.mark.e2e
def test_images_against_the_stack(family_model_dir, tmp_path):
    model = family_model_dir("gemma3-vision")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH / "cameras" / "images.py"), "--model-dir", str(model), "--contenders", "stack",
         "--runs", "1", "--images", "1", "2", "--num-requests", "2", "--concurrency", "2",
         "--output-tokens", "4", "--image-width", "64", "--image-height", "48", "--threads", "1",
         "--out-dir", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for n in (1, 2):
        run = json.loads((out / f"stack-{n}-0.json").read_text())
        assert run["num_requests"] == 2 and run["failed"] == 0 and run["images_per_request"] == n
        assert run["total_output_tokens"] == 8  # ignore_eos: exactly --output-tokens each
        assert run["image_throughput"] == pytest.approx(n * run["request_throughput"])
        steps = run["server_steps"]  # the worker's own /metrics over the measured run
        assert steps["images_encoded"] == 2 * n, steps  # every frame new, each encoded once
        assert 0 < steps["encoder_s"] < steps["step_s"] and 0 < steps["encoder_share"] < 1, steps
        row = summary["rows"][f"stack/{n}"]
        assert row["request_throughput_runs"] == [run["request_throughput"]]
        assert row["encoder_share_median"] == steps["encoder_share"] and row["stack_over_this_runs"] == [1.0]
        assert row["ttft_s_p50_median"] > 0 and row["failed"] == 0
    assert "| stack | 2 | **" in done.stdout and "2 image(s) a request:" in done.stdout
    assert Path(summary["args"]["model_dir"]) == model
