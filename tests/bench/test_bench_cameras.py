"""bench/cameras/cameras.py, the camera-stream benchmark: its schedule and frames, and short runs
against the real stack on the tiny gemma3-vision checkpoint in each mode (uuid, --no-uuid,
--text-only, --upload), whose counts the gateway's, the worker's and the encoder service's
/metrics must agree with."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import pytest
from PIL import Image

from proto.metrics_scrape import parse_samples
from tests.support.stack_helpers import running_stack
from tests.bench.test_bench_compare import BENCH, bench_module


@pytest.fixture(scope="module")
def cameras():
    return bench_module("cameras.cameras")


def test_the_schedule_staggers_the_cameras_and_frames_are_distinct(cameras):
    args = cameras.build_parser().parse_args(["--cameras", "2", "--fps", "2", "--ask-every", "1",
                                              "--frames", "3", "--duration", "2.2"])
    assert cameras.schedule(args) == [(0.0, 0, 0), (0.5, 1, 0), (1.0, 0, 1), (1.5, 1, 1), (2.0, 0, 2)]
    assert [cameras.newest_frame(args, t) for t in (0.0, 0.5, 1.0, 2.0)] == [2, 3, 4, 6]  # N frames at once
    frames = cameras.draw_frames(3, 1, 4, 80, 60, 85)
    assert len(set(frames)) == 4 and not set(frames) & set(cameras.draw_frames(4, 1, 4, 80, 60, 85))
    image = Image.open(io.BytesIO(base64.b64decode(frames[0])))
    assert image.format == "JPEG" and image.size == (80, 60)


def test_server_counters_add_up_every_series_once_whichever_pages_show_it(cameras):
    def page(worker: str, encoded: int, stored: int | None = None) -> str:
        text = f'pagedserve:mm_items_encoded_total{{worker="{worker}"}} {encoded}\n'
        return text + (f'pagedserve:mm_items_stored_total{{model_name="m"}} {stored}\n' if stored is not None else "")

    before = [parse_samples(page("w", 2, 5)), parse_samples(page("v", 1))]
    after = [parse_samples(page("w", 7, 9)), parse_samples(page("v", 4))]
    counters = cameras.server_counters(before, after)
    assert counters["encoded"] == 8 and counters["stored"] == 4 and counters["encoder_s"] is None
    assert counters["encoded_by_workers"] == 8 and counters["encoded_by_encoders"] is None
    # the gateway's page shows worker w's counter too, a second behind its own: counted once, the freshest
    gateway_before, gateway_after = parse_samples(page("w", 2, 5)), parse_samples(page("w", 6, 9))
    own_before, own_after = parse_samples(page("w", 2)), parse_samples(page("w", 7))
    counters = cameras.server_counters([gateway_before, own_before], [gateway_after, own_after])
    assert counters["encoded"] == counters["encoded_by_workers"] == 5 and counters["stored"] == 4


def test_settle_waits_for_the_counters_to_stand_still(cameras):
    """The gateway's copy of a worker's counters lags by up to the scheduler's stats
    interval: a page read while they still move is not taken."""
    import http.server
    import threading

    values = iter([3, 5, 6, 6, 6, 9])  # the scheduler's copy catching up, then still

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f'pagedserve:mm_items_encoded_total{{worker="w"}} {next(values)}\n'.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        pages = cameras.settle([url], quiet_s=0.01)
        assert cameras.server_counters([{}], pages)["encoded"] == 6
    finally:
        server.shutdown()


def test_server_counters_split_the_encoding_by_workers_and_encoder_services(cameras):
    def worker(encoded: int, seconds: float) -> str:
        return (f'pagedserve:mm_items_encoded_total{{worker="worker-0"}} {encoded}\n'
                f'pagedserve:mm_cache_queries_total{{worker="worker-0"}} {encoded + 10}\n'
                f'pagedserve:mm_cache_hits_total{{worker="worker-0"}} 10\n'
                '# TYPE pagedserve:encoder_seconds histogram\n'
                f'pagedserve:encoder_seconds_count{{worker="worker-0"}} 1\n'
                f'pagedserve:encoder_seconds_sum{{worker="worker-0"}} {seconds}\n')

    def encoder(encoded: int, seconds: float, depth: int) -> str:
        return (f'pagedserve:mm_items_encoded_total{{encoder="encoder-0"}} {encoded}\n'
                f'pagedserve:mm_embeddings_published_total{{encoder="encoder-0"}} {encoded}\n'
                '# TYPE pagedserve:encoder_seconds histogram\n'
                f'pagedserve:encoder_seconds_count{{encoder="encoder-0"}} {encoded}\n'
                f'pagedserve:encoder_seconds_sum{{encoder="encoder-0"}} {seconds}\n'
                f'pagedserve:encoder_queue_depth{{encoder="encoder-0"}} {depth}\n')

    before = [parse_samples(worker(1, 0.5)), parse_samples(encoder(2, 1.0, 3))]
    after = [parse_samples(worker(3, 1.5)), parse_samples(encoder(9, 4.5, 1))]
    c = cameras.server_counters(before, after)
    assert (c["encoded"], c["encoded_by_workers"], c["encoded_by_encoders"]) == (9, 2, 7)
    assert (c["encoder_s"], c["encoders_s"], c["encoders_batches"], c["published"]) == (1.0, 3.5, 7, 7)
    assert (c["mm_queries"], c["mm_ready"], c["encoder_queue_depth"]) == (2, 0, 1)


def test_upload_mode_names_frames_by_file_id_and_excludes_the_other_modes(cameras):
    args = cameras.build_parser().parse_args(["--seed", "5", "--upload"])
    q = cameras.Question(0, 2, 0.0)
    (message,) = cameras.file_messages(args, 0, 2, range(3, 6), ["file-a", None, "file-c"], q)
    files = message["content"][1:-1]
    assert files == [{"type": "file", "file": {"file_id": "file-a"}}, {"type": "file", "file": {"file_id": "file-c"}}]
    assert (q.by_file, q.missing, q.with_data, q.upload_bytes) == (2, 1, 0, 0)
    for other in ("--no-uuid", "--text-only"):
        with pytest.raises(SystemExit):
            cameras.build_parser().parse_args(["--upload", other])


def test_a_question_names_frames_sent_before_by_uuid(cameras):
    args = cameras.build_parser().parse_args(["--seed", "5"])
    q = cameras.Question(1, 3, 0.0)
    (message,) = cameras.image_messages(args, ["AAAA", "BBBB", "CCCC"], 1, 3, range(3), {0, 1}, q)
    images = message["content"][1:-1]
    assert [p["uuid"] for p in images] == ["s5-cam1-0", "s5-cam1-1", "s5-cam1-2"]
    assert [p["image_url"] for p in images[:2]] == [None, None]
    assert images[2]["image_url"] == {"url": "data:image/jpeg;base64,CCCC"}
    assert (q.with_data, q.by_uuid, q.upload_bytes) == (1, 2, 4)


@pytest.fixture(scope="module")
def stack(vision_dir, redis_url, tmp_path_factory):
    with running_stack(vision_dir, redis_url, tmp_path_factory.mktemp("bench-cameras")) as s:
        yield s


def bench(stack, tmp_path, *mode: str) -> dict:
    out = tmp_path / f"cameras{''.join(mode)}.json"
    urls = stack.metrics_urls  # the gateway's, the worker's, and any encoder service's
    pages = [url for name, url in urls.items() if name == "gateway" or name.startswith(("worker-", "encoder-"))]
    done = subprocess.run(
        [sys.executable, str(BENCH / "cameras" / "cameras.py"), "--base-url", stack.base_url,
         "--model", stack.served_model_name,
         "--cameras", "2", "--fps", "1", "--ask-every", "1", "--frames", "4", "--duration", "4",
         "--width", "160", "--height", "120", "--max-tokens", "4", "--metrics-url", *pages,
         "--json", str(out), *mode],
        capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "questions" in done.stdout and "TTFT" in done.stdout
    return json.loads(out.read_text())


@pytest.mark.e2e
def test_camera_streams_against_the_stack(stack, tmp_path):
    uuid = bench(stack, tmp_path)  # a new seed each run: no frame of one run is in another
    assert uuid["questions_failed"] == 0, uuid["errors"]
    assert uuid["questions_sent"] + uuid["questions_skipped"] == uuid["questions_scheduled"] == 8
    assert uuid["output_tokens"] == 4 * uuid["questions_sent"]
    server = uuid["server"]
    # every frame sent with its data once, then by uuid; each decoded, stored and encoded once
    assert uuid["frames_with_data"] == uuid["frames_distinct"] == server["received"] == server["stored"]
    assert server["encoded"] == uuid["frames_distinct"] and uuid["encoded_once"] is True, server
    assert uuid["frames_by_uuid"] == server["by_uuid"] > 0 and server["reused"] == 0
    assert server["cache_hits"] >= uuid["frames_by_uuid"] and server["encoder_s"] > 0

    again = bench(stack, tmp_path, "--no-uuid")  # every frame's data each time: the hash dedups
    assert again["questions_failed"] == 0, again["errors"]
    server = again["server"]
    assert again["frames_by_uuid"] == server["by_uuid"] == 0
    assert again["frames_with_data"] == server["received"] == 4 * again["questions_sent"]
    assert server["stored"] == again["frames_distinct"] == server["encoded"] and again["encoded_once"] is True
    assert server["reused"] == again["frames_with_data"] - again["frames_distinct"]

    text = bench(stack, tmp_path, "--text-only")  # a prompt as long as the frames', no frame
    assert text["questions_failed"] == 0, text["errors"]
    assert text["server"]["encoded"] == 0 and text["frames_with_data"] == 0 and text["encoded_once"] is None
    target = sum(text["warmup_image_prompt_tokens"]) / 2
    assert abs(text["prompt_tokens_mean"] - target) <= 2, (text["prompt_tokens_mean"], text["text_filler"])


@pytest.mark.e2e
def test_uploaded_camera_frames_are_encoded_by_the_encoder_service(stack, tmp_path):
    # an encoder service joins the stack of the runs above: from now on what a gateway
    # stores is encoded ahead of the questions (a stack of its own would cost its start)
    encoder = stack.add_encoder(extra=("--threads", "1"))
    try:
        up = bench(stack, tmp_path, "--upload")  # each frame a POST /v1/files, questions name file ids
    finally:
        stack.stop_process(encoder)
    assert up["questions_failed"] == 0 and up["uploads_failed"] == 0, up["errors"] + up["upload_errors"]
    assert up["questions_sent"] + up["questions_skipped"] == up["questions_scheduled"] == 8
    assert up["frames_with_data"] == up["frames_by_uuid"] == up["frames_missing"] == 0
    assert up["frames_by_file"] == 4 * up["questions_sent"] and up["frames_distinct"] <= up["frames_uploaded"] == 14
    assert up["files_deleted"] == up["frames_uploaded"] + 4  # and the warm-up's 4
    server = up["server"]
    # every frame uploaded encoded once, by the encoder service, none by the worker
    assert server["encoded_by_workers"] == 0 and server["encoded_by_encoders"] == up["frames_uploaded"], server
    assert server["encoded"] == up["frames_to_encode"] == up["frames_uploaded"] and up["encoded_once"] is True
    assert server["mm_ready"] == server["mm_queries"] > 0 and server["encoders_s"] > 0
    assert server["encode_failed"] == 0 and server["encoder_queue_depth"] == 0


def test_pagedserve_bench_cameras_runs_the_camera_benchmark(capsys):
    from compose.cli import main

    assert main(["bench", "cameras", "--help"]) == 0
    assert "--upload" in capsys.readouterr().out
