"""bench/stack/compare.py: one interleaved round of the stack and the in-process engine on the
tiny model, and the per-run step / gap reading it takes from each server's /metrics."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proto.metrics_scrape import parse_samples

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str):
    """bench/<group>/<module>.py (name: "group.module"), imported as `bench.group.module`: by
    its full name, as the benchmarks import each other (bench/README.md)."""
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="module")
def compare():
    return bench_module("stack.compare")


def page(steps: int, step_sum: float, gaps: int, gap_sum: float) -> str:
    return (f'pagedserve:step_duration_seconds_count{{worker="w"}} {steps}\n'
            f'pagedserve:step_duration_seconds_sum{{worker="w"}} {step_sum}\n'
            f'pagedserve:step_gap_seconds_count{{worker="w"}} {gaps}\n'
            f'pagedserve:step_gap_seconds_sum{{worker="w"}} {gap_sum}\n')


def test_step_split_is_the_difference_of_two_scrapes(compare):
    before = parse_samples(page(10, 1.0, 8, 0.08))
    after = parse_samples(page(30, 3.0, 27, 0.118))
    split = compare.step_split(before, after)
    assert split["steps"] == 20
    assert split["step_mean_s"] == pytest.approx(0.1)
    assert split["gap_mean_s"] == pytest.approx(0.002)
    assert compare.step_split(before, before) == {"steps": 0, "step_mean_s": None, "gap_mean_s": None}


@pytest.fixture(scope="module")
def proc_cpu():
    return bench_module("common.proc_cpu")


def test_cpu_by_process_counts_a_child_by_what_it_runs(proc_cpu, tmp_path):
    script = tmp_path / "spin.py"
    script.write_text("import sys, time\nend = time.process_time() + 0.4\nwhile time.process_time() < end: pass\n"
                      "sys.stdin.read()\n")  # then waits, so it is still there to be read
    before = proc_cpu.cpu_by_process(os.getpid())
    child = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (used := proc_cpu.cpu_used(before, proc_cpu.cpu_by_process(os.getpid()))).get("spin.py", 0) < 0.35:
            assert time.monotonic() < deadline, used
            time.sleep(0.1)
        assert used["spin.py"] < 5 and child.pid in {pid for pid, _ in proc_cpu.cpu_by_process(os.getpid())}
    finally:
        child.communicate(b"")
    def name(*argv: str) -> str:
        return proc_cpu.process_name(b"\x00".join(a.encode() for a in argv) + b"\x00")

    assert name("/v/bin/python", "-m", "compose.cli", "worker", "--port", "1") == "worker"
    assert name("/usr/bin/python3.11", "-u", "-X", "dev", "-m", "uvicorn", "app") == "uvicorn"
    assert name("/usr/bin/python3", "-c", "pass") == "python3"
    assert name("/v/bin/python", "/v/bin/transformers", "serve") == "transformers"
    assert name("/usr/bin/redis-server 127.0.0.1:6379") == "redis-server"  # its own title


def dying_server(tmp_path: Path, after_s: float) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", f"import time; print('loading the model', flush=True); "
                                 f"time.sleep({after_s}); raise SystemExit('out of memory')"],
                                stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def test_hf_serve_runs_the_transformers_command_of_this_environment(compare, monkeypatch):
    """The venv's own `transformers`, also when the venv's bin/ is not on PATH (its python
    run by path, as the docs' commands do)."""
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert compare.transformers_cli() == str(Path(sys.executable).parent / "transformers")


def test_hf_serve_without_its_command_fails_before_the_first_round(compare, monkeypatch, tmp_path):
    monkeypatch.setattr(compare.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"transformers.*make bench"):
        compare.check_contenders(["stack", "hf-serve"])
    compare.check_contenders(["stack", "engine"])  # they need neither


def test_hf_serve_needs_accelerate(compare):
    if importlib.util.find_spec("accelerate") is None:
        with pytest.raises(SystemExit, match=r"accelerate.*make bench"):
            compare.check_contenders(["hf-serve"])
    else:
        compare.check_contenders(["hf-serve"])


def test_a_server_that_dies_while_starting_fails_the_run_with_its_log(compare, tmp_path):
    proc, log = dying_server(tmp_path, 0.2)
    with pytest.raises(compare.ServerDied, match="(?s)hf-serve exited with status 1.*loading the model.*out of memory"):
        compare.wait_http("http://127.0.0.1:9/health", proc, "hf-serve", log, timeout=120)


def test_a_server_that_dies_during_the_run_stops_the_client(compare, tmp_path):
    proc, log = dying_server(tmp_path, 1.0)
    with pytest.raises(compare.ServerDied, match="out of memory"):  # a client that outlived it ends normally
        compare.run_client([sys.executable, "-c", "import time; time.sleep(120)"], proc, "stack", log)


@pytest.mark.e2e
def test_one_round_of_stack_and_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH / "stack" / "compare.py"), "--model-dir", str(tiny_model_dir),
         "--contenders", "stack", "engine", "--runs", "1", "--concurrency", "4", "--num-requests", "8",
         "--input-mean", "24", "--output-mean", "12", "--threads", "1", "--out-dir", str(out),
         "--dtype", "bfloat16", "--quantization", "int8"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    for name in ("stack", "engine"):
        run = json.loads((out / f"{name}-0.json").read_text())
        assert run["num_requests"] == 8 and run["failed"] == 0, name
        steps = run["server_steps"]
        # A request of k output tokens takes k steps (its prompt fits one), and every step
        # samples at least one token: from the longest output (>= 12 / 2) to all of them.
        assert 6 <= steps["steps"] <= run["total_output_tokens"], (name, steps)
        assert steps["step_mean_s"] > 0 and steps["gap_mean_s"] >= 0, (name, steps)
        row = summary["contenders"][name]
        assert row["step_mean_s_median"] == steps["step_mean_s"]
        cpu = run["server_cpu_s"]  # the server's processes over the measured run, by name
        expected = {"worker", "scheduler", "gateway", "redis-server"} if name == "stack" else {"engine"}
        assert expected <= cpu.keys() and all(cpu[p] > 0 for p in expected - {"redis-server"}), (name, cpu)
        assert run["client_cpu_s"] > 0 and row["cpu_s_median"]["benchmark client"] == run["client_cpu_s"]
    assert summary["contenders"]["engine"]["stack_over_this_runs"][0] > 0
    assert summary["args"]["dtype"] == "bfloat16" and summary["args"]["quantization"] == "int8"
    assert f"machine: {summary['machine']}; device cpu, dtype bfloat16, stack/engine weights int8" in done.stdout
    for name in ("stack", "engine"):  # each one's worker said what it served in
        logs = "".join(p.read_text(errors="replace")
                       for p in [out / f"{name}.log", *(out / f"run-{name}").rglob("*.log")] if p.exists())
        assert "serving in bfloat16 (--dtype bfloat16)" in logs and "int8 weights" in logs, name
    assert "| step / gap (mean) |" in done.stdout
    assert done.stdout.count(" ms |") >= 2  # both rows have their step / gap cell


@pytest.mark.e2e
def test_the_engine_serves_an_fp32_model_over_a_bf16_kv_cache(tiny_model_dir, tmp_path):
    """`--kv-cache-dtype bfloat16` from compare.py through `pagedserve engine`'s flags to the
    runner: every request served, the worker's log says the cache's dtype and why."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(BENCH / "stack" / "compare.py"), "--model-dir", str(tiny_model_dir),
         "--contenders", "engine", "--runs", "1", "--concurrency", "4", "--num-requests", "8",
         "--input-mean", "24", "--output-mean", "12", "--threads", "1", "--out-dir", str(out),
         "--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads((out / "engine-0.json").read_text())
    assert run["num_requests"] == 8 and run["failed"] == 0
    assert "dtype float32, stack/engine KV cache bfloat16" in done.stdout
    log = (out / "engine.log").read_text(errors="replace")
    assert "serving in float32" in log and "KV cache in bfloat16 (--kv-cache-dtype bfloat16)" in log
