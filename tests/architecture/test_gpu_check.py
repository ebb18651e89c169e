""".ci/gpu/: what the bundle carries, and how the check runs its steps (a step that fails
or runs past its time box is reported and the next one runs; a failed install skips the
rest). The whole check runs with `make gpu-dry-run` (minutes: a venv of the GPU image's
packages), not here."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[2] / ".ci" / "gpu"


def gpu_module(name: str):
    spec = importlib.util.spec_from_file_location(f"ci_gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bundle = gpu_module("bundle")
check = gpu_module("check")


def test_image_list_parses_names_and_known_versions():
    image = bundle.image_packages()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0"
    assert image["grpcio"] == "1.84.0"  # there, older than proto/'s generated code needs
    assert "fastapi" not in image and "redis" not in image


def test_what_travels():
    image = {"torch": "2.11.0", "grpcio": "1.84.0", "protobuf": "7.36.2", "jinja2": None, "pillow": None}
    reqs = ["torch", "grpcio", "protobuf", "jinja2", "fastapi", "msgspec", "av", "pillow"]
    assert bundle.to_carry(reqs, image) == ["grpcio", "fastapi", "msgspec"]
    pins = [("anyio", "4"), ("fastapi", "1"), ("grpcio", "1.85.1"), ("jinja2", "3"), ("av", "18")]
    assert bundle.bundle_pins(pins, {"anyio": None, "grpcio": None, "jinja2": None}) == [
        ("fastapi", "1"), ("grpcio", "1.85.1")]
    assert bundle.canonical("typing_extensions") == "typing-extensions"
    assert bundle.requirement_name("Foo_Bar[x]>=1; python_version>'3'") == "foo-bar"


def test_every_requirement_is_in_the_image_carried_or_left_out_with_a_reason():
    image = bundle.image_packages()
    carried = {bundle.requirement_name(r) for r in bundle.to_carry(bundle.stack_requirements(), image)}
    for req in bundle.stack_requirements():
        name = bundle.requirement_name(req)
        assert name in carried or (name in image and name not in bundle.CARRY_ANYWAY) or name in bundle.LEFT_OUT


def run_check(tmp_path, **kw) -> "check.Check":
    args = argparse.Namespace(out=tmp_path / "out", work=tmp_path / "work", budget_s=kw.get("budget_s", 60.0),
                              limit_scale=1.0, device=kw.get("device", "cpu"), bundle=tmp_path / "bundle",
                              test_workers=1, serving_concurrency=None,
                              kernels_baseline=None)
    return check.Check(args)


def test_a_step_past_its_time_box_is_stopped_and_reported(tmp_path, monkeypatch):
    c = run_check(tmp_path)
    monkeypatch.setitem(check.LIMITS, "kernels", 1.0)
    t0 = time.monotonic()
    result = c.step("kernels", lambda limit: check.StepResult(
        "kernels", "timeout" if c.run([sys.executable, "-c", "import time; time.sleep(30)"], limit) is None
        else "passed"))
    assert result.status == "timeout" and time.monotonic() - t0 < 10


def test_a_failing_step_is_reported_and_the_budget_skips_what_does_not_fit(tmp_path):
    c = run_check(tmp_path, budget_s=7.0)

    def broken(limit):
        raise RuntimeError("boom")

    assert c.step("tests", broken).status == "failed"
    assert "boom" in c.step("tests", broken).reason
    time.sleep(3)
    assert c.step("serving", broken).status == "skipped"  # under 5 s left of the budget


def test_a_fleet_run_that_the_time_left_cannot_hold_is_skipped_not_started(tmp_path):
    c = run_check(tmp_path)
    t0 = time.monotonic()
    result = c.fleet(limit=5.0)  # the CPU run measures 8 s, and starting it takes more
    assert time.monotonic() - t0 < 1 and result.status == "skipped"
    assert all(r.startswith("skipped") for r in result.results.values()) and "no time left" in result.reason


def test_a_missing_bundle_fails_the_install_and_skips_the_rest(tmp_path):
    assert check.main(["--device", "cpu", "--bundle", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                       "--work", str(tmp_path / "work")]) == 1
    import json

    report = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    assert statuses["install"] == "failed"
    assert {statuses[n] for n in ("tests", "kernels", "serving", "vision")} == {"skipped"}


def test_junit_summary_counts_and_names_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="tests.test_x" name="test_a"/>'
                   '<testcase classname="tests.test_x" name="test_b">'
                   '<failure message="assert 1 == 2">x</failure></testcase>'
                   '<testcase classname="tests.test_x" name="test_c"><skipped message="needs CUDA"/></testcase>'
                   '</testsuite></testsuites>')
    s = check.junit_summary(xml)
    assert (s["tests"], s["failures"], s["skipped"]) == (3, 1, 1)
    assert s["failed"] == [{"test": "tests.test_x::test_b", "message": "assert 1 == 2"}]


@pytest.mark.parametrize("vision", [False, True])
def test_gpu_test_files_are_found_by_their_marker(tmp_path, vision):
    files = run_check(tmp_path).gpu_test_files(vision=vision)
    if not vision:
        assert {"tests/unit/kernels/test_triton_kernels.py", "tests/gpu/test_cuda_runner.py",
                "tests/unit/kernels/test_triton_bidirectional.py"} <= set(files)  # the last: marks through triton_cases
    assert all(("vision" in f) == vision for f in files)


@pytest.mark.parametrize("device,status", [("cpu", "skipped"), ("cuda", "failed")])
def test_a_test_step_in_which_no_test_ran_is_no_pass(tmp_path, device, status):
    """Every GPU test skipped: on the CPU dry run that is expected (skipped); on a GPU
    nothing was checked, so the step fails instead of counting as passed."""
    test_file = tmp_path / "test_all_skip.py"
    test_file.write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    pytest.skip('needs CUDA')\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: on a GPU\n")
    result = run_check(tmp_path, device=device).pytest("tests", [str(test_file)], limit=60.0)
    assert result.status == status and "all 1 tests skipped" in result.reason
