"""`make gpu-check`: the CUDA path checked and measured in one prepared call on a lent GPU.

    python .ci/gpu/check.py [--device cuda|cpu] [--bundle .gpu-bundle] [--out DIR]

A lent GPU machine is there for minutes, without network, with its own Python and torch
(.ci/gpu/image-packages.txt). This script is the whole visit: it installs the bundle
`make gpu-bundle` prepared (.ci/gpu/bundle.py) without network -- the wheels with
`pip install --no-index --no-deps --target`, Redis with `dpkg -x` -- never touching the
machine's torch, then runs these steps in order, each in a subprocess with its own time
box inside one overall budget (`--budget-s`, 480 s), carrying on past a step that fails:

  install   the bundle's wheels and Redis; every service's modules import
  tune      bench/compute/tune_attention.py: the Triton attention's candidate tiles timed per
            phase and layout; the winners written over kernels/triton_tuned.json in this
            tree (so the steps after it test and time the new tiles, not the committed
            ones) and, with every timing, to --out (commit the file from there)
  tests     the GPU-marked tests (`pytest -m gpu`; tests/gpu/, and the CUDA cases of the
            kernel and worker tests in tests/unit/): Triton kernels against the torch
            references in fp16/bf16, the CUDA worker against transformers, CUDA-graph
            replay against eager steps (on a GPU, a run in which every test skipped fails:
            nothing was checked)
  vision    the GPU-marked Gemma 3 vision tests (tests/**/*vision*.py): the vision encoder,
            and images through the runner (Triton with bidirectional image spans), against
            transformers on CUDA
  kernels   bench/compute/kernels.py --quick: decode attention bandwidth against a measured device
            copy, paged against contiguous SDPA, prefill TFLOP/s against flash SDPA (causal,
            and a camera question's 8 frames of bidirectional tokens), the sampler's race,
            and the Gemma 3 vision tower at 896 px (bench/compute/vision_tower.py)
  serving   .ci/gpu/serving.py: the `1b` preset in bf16, made there from the carried
            tokenizer; decode steps' model-bandwidth utilisation and kernels per step, with
            CUDA graphs and with --enforce-eager (bench/compute/roofline.py); the stack against the
            in-process engine at each --serving-concurrency (256 and 64; none: skipped); a
            mixed step against its parts' floors (bench/compute/mixed_step.py)
  cameras   .ci/gpu/camera_serving.py: gemma-3-12b-it's release config with weights made on
            the device (--load-format dummy, bf16) served by the stack; the camera workload
            at 2, 4, 8, 12, 16 cameras, frames by file_id with an encoder service (which
            encodes them as uploaded) and without one (the worker encodes them), and as
            text of the same length; questions/s, TTFT p50/p90, images encoded/s, tok/s,
            the largest K at TTFT p90 <= 1 s, beside the physical limit
            (bench/cameras/camera_limits.py); not among the default steps (its 420 s want a
            check of their own: --steps install cameras)
  fleet     bench/stack/fleet.py on the machine's 16 cores (no GPU: the model is simulated): one
            scheduler driving 64 workers at 30 ms steps, 256 workers sharded over 8
            schedulers at 100 ms, and the same 256 on one scheduler (FLEET_RUNS), as many
            of them as the budget has room for

With `--device cpu` (the dry run here, in a venv holding only the image's packages:
.ci/gpu/image_venv.py) every step that can run on a CPU runs -- the install, the GPU tests'
collection, serving on the `tiny` preset -- and the CUDA ones are reported as skipped. Writes
`gpu-check.json` (the machine, the packages found there, each step's status, seconds and
results) and `gpu-check.log` (every step's output) under `--out` (default: $OUT when set, else
./gpu-check-out), and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Each step's own limit in seconds, on CUDA; the overall budget caps what is left.
# In this order: the CUDA path first; the fleet (CPU only) takes what the budget has left.
LIMITS = {"install": 60, "tune": 200, "tests": 160, "vision": 60, "kernels": 180, "serving": 340, "cameras": 420,
          "fleet": 270}
# bench/stack/fleet.py on the machine's CPUs (the model is simulated): name -> flags. One scheduler
# at a GPU-like 30 ms step; 256 workers at 100 ms steps (what 16 cores can simulate: the
# simulated workers, gateways and clients cost more CPU per step than the schedulers)
# sharded over 8 schedulers, and the same load on one scheduler (its prefix hit rate).
FLEET_RUNS = {
    "one-scheduler-64": ["--workers", "64", "--schedulers", "1", "--step-ms", "30", "--duration", "20",
                         "--baseline-duration", "8", "--gateways", "2", "--prefixes", "16"],
    "sharded-256": ["--workers", "256", "--schedulers", "8", "--step-ms", "100", "--concurrency", "1024",
                    "--output-tokens", "64", "--duration", "30", "--baseline-duration", "8", "--gateways", "4",
                    "--prefixes", "64"],
    "one-scheduler-256": ["--workers", "256", "--schedulers", "1", "--step-ms", "100", "--concurrency", "1024",
                          "--output-tokens", "64", "--duration", "30", "--baseline-duration", "0",
                          "--gateways", "4", "--prefixes", "64"],
}
FLEET_START_S = 30  # a fleet run's start and stop beyond its measured seconds (16 cores)
FLEET_RUNS_CPU = {"one-scheduler-4": ["--workers", "4", "--step-ms", "30", "--duration", "5",
                                      "--baseline-duration", "3"]}
IMPORTS = ("import fastapi, uvicorn, redis, msgspec, grpc, google.protobuf, llguidance, cffi, "
           "transformers, torch; import gateway.app, scheduler_svc.service, worker_svc.server, "
           "compose.cli; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())")


@dataclass
class StepResult:
    name: str
    status: str  # passed | failed | timeout | skipped
    seconds: float = 0.0
    reason: str = ""
    results: dict = field(default_factory=dict)


class Check:
    """The run: one log, one environment for every step's subprocess, one time budget."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out: Path = args.out
        self.work: Path = args.work
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = (self.out / "gpu-check.log").open("a", buffering=1)
        self.deadline = time.monotonic() + args.budget_s
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                        TOKENIZERS_PARALLELISM="false")
        self.cuda = args.device == "cuda"

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def limit(self, step: str) -> tuple[float, bool]:
        """(the step's time box, whether enough of the budget is left to start it)."""
        own, left = LIMITS[step] * self.args.limit_scale, self.deadline - time.monotonic()
        return max(0.0, min(own, left)), left >= min(5.0, own)

    def run(self, cmd: list[str], timeout: float, env: dict | None = None, cwd: Path = ROOT) -> int | None:
        """Run `cmd` with its output in the log; its exit code, or None when it ran past `timeout`."""
        self.log.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env or self.env, stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return None

    def step(self, name: str, fn) -> StepResult:
        limit, fits = self.limit(name)
        self.say(f"== {name} (limit {limit:.0f} s)")
        if not fits:
            result = StepResult(name, "skipped", reason="no time left in the budget")
        else:
            t0 = time.monotonic()
            try:
                result = fn(limit)
            except Exception as exc:  # a broken step is reported, and the next one runs
                result = StepResult(name, "failed", reason=f"{type(exc).__name__}: {exc}")
            result.seconds = round(time.monotonic() - t0, 1)
        self.say(f"== {name}: {result.status} in {result.seconds:.0f} s"
                 + (f" -- {result.reason}" if result.reason else ""))
        return result

    # -- install ---------------------------------------------------------------------------------

    def install(self, limit: float) -> StepResult:
        bundle: Path = self.args.bundle
        manifest = json.loads((bundle / "manifest.json").read_text())
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if manifest["python_version"] != here:
            return StepResult("install", "failed", reason=f"the bundle is for Python {manifest['python_version']}, "
                                                          f"this is {here}: make gpu-bundle GPU_PYTHON_VERSION={here}")
        site, redis_root, bin_dir = self.work / "site", self.work / "redis", self.work / "bin"
        for d in (site, redis_root, bin_dir):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        wheels = sorted(str(w) for w in (bundle / "wheels").glob("*.whl"))
        code = self.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                         "--no-cache-dir", "--disable-pip-version-check", "--target", str(site), *wheels], limit)
        if code != 0:
            return StepResult("install", "failed", reason=f"pip install of the bundle's wheels: exit {code}")
        for deb in sorted((bundle / "debs").glob("*.deb")):
            if self.run(["dpkg", "-x", str(deb), str(redis_root)], 30) != 0:
                return StepResult("install", "failed", reason=f"dpkg -x {deb.name}")
        libs = redis_root / "usr/lib/x86_64-linux-gnu"
        wrapper = bin_dir / "redis-server"  # its libraries for Redis alone, not for Python
        wrapper.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH="{libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
                           f'exec "{redis_root}/usr/bin/redis-server" "$@"\n')
        wrapper.chmod(0o755)
        self.env["PATH"] = f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}"
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(ROOT), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        version = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, env=self.env)
        if version.returncode != 0:
            return StepResult("install", "failed", reason=f"redis-server: {version.stderr.strip()[-300:]}")
        imports = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, env=self.env,
                                 cwd=ROOT, timeout=max(limit, 10))
        self.log.write(imports.stdout + imports.stderr)
        if imports.returncode != 0:
            return StepResult("install", "failed", reason=f"imports: {imports.stderr.strip().splitlines()[-1:]}")
        return StepResult("install", "passed", results={
            "wheels": len(wheels), "redis": version.stdout.split()[2] if version.stdout else "",
            "torch_cuda_available": imports.stdout.split()})

    # -- pytest steps ----------------------------------------------------------------------------

    def gpu_test_files(self, vision: bool) -> list[str]:
        """The test files with GPU-marked cases: every file of tests/gpu/ (its folder marks
        them), and those elsewhere that mark some or import a test helper module that does
        (tests/support/triton_cases.py's devices)."""
        tests = ROOT / "tests"
        helpers = [p.stem for p in (tests / "support").glob("*.py") if "mark.gpu" in p.read_text()]
        files = []
        for path in sorted(tests.rglob("test_*.py")):
            text = path.read_text()
            marked = (path.parent == tests / "gpu" or "mark.gpu" in text
                      or any(f"import {h}" in text or f"{h} import" in text for h in helpers))
            if marked and ("vision" in path.name) == vision:
                files.append(str(path.relative_to(ROOT)))
        return files

    def pytest(self, name: str, files: list[str], limit: float) -> StepResult:
        if not files:
            return StepResult(name, "skipped", reason="no GPU-marked test files")
        xml = self.work / f"{name}.xml"
        xml.unlink(missing_ok=True)
        # pytest-xdist (in the GPU image) spreads the Triton compiles over the machine's cores
        xdist = subprocess.run([sys.executable, "-c", "import xdist"], env=self.env, capture_output=True)
        workers = ["-n", str(self.args.test_workers)] if xdist.returncode == 0 and self.args.test_workers > 1 else []
        code = self.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         "-o", "addopts=-ra", *workers, f"--junitxml={xml}", *files], limit)
        if code is None:
            return StepResult(name, "timeout", reason=f"pytest ran past {limit:.0f} s", results={"files": files})
        results = junit_summary(xml) if xml.exists() else {}
        results["files"] = files
        ran = results.get("tests", 0) - results.get("skipped", 0)
        if code == 0 and ran == 0:  # nothing was checked: on a GPU that is a failure, not a pass
            status = "failed" if self.cuda else "skipped"
            return StepResult(name, status, reason=f"all {results.get('tests', 0)} tests skipped"
                              + (" on the GPU: none ran" if self.cuda else " (no CUDA here)"), results=results)
        status = "passed" if code == 0 else "failed"
        reason = "" if code == 0 else f"pytest exit {code}: {len(results.get('failed', []))} failed"
        return StepResult(name, status, reason=reason, results=results)

    def tests(self, limit: float) -> StepResult:
        return self.pytest("tests", self.gpu_test_files(vision=False), limit)

    def vision(self, limit: float) -> StepResult:
        return self.pytest("vision", self.gpu_test_files(vision=True), limit)

    # -- benches ---------------------------------------------------------------------------------

    def bench(self, name: str, cmd: list[str], out: Path, limit: float, note: str = "") -> StepResult:
        """A bench script that writes its JSON to `out`: passed (with `note`) and its results,
        or failed / timeout with whatever it wrote before."""
        out.unlink(missing_ok=True)
        code = self.run(cmd, limit)
        results = json.loads(out.read_text()) if out.exists() else {}
        if code is None:
            return StepResult(name, "timeout", reason=f"ran past {limit:.0f} s", results=results)
        if code != 0:
            return StepResult(name, "failed", reason=f"exit {code}", results=results)
        return StepResult(name, "passed", reason=note, results=results)

    def kernels(self, limit: float) -> StepResult:
        if not self.cuda:  # (Triton 3.6's interpreter, the image's, fails on NumPy >= 2.4 arrays)
            return StepResult("kernels", "skipped", reason="needs CUDA; the script's --smoke run on the CPU "
                                                           "is tests/bench/test_bench_kernels.py")
        out = self.out / "kernels.json"
        baseline = ["--baseline", str(self.args.kernels_baseline)] if self.args.kernels_baseline else []
        return self.bench("kernels", [sys.executable, "bench/compute/kernels.py", "--quick", "--json", str(out),
                                      *baseline], out, limit)

    def tune(self, limit: float) -> StepResult:
        if not self.cuda:
            return StepResult("tune", "skipped", reason="needs CUDA; its --smoke run on the CPU is "
                                                        "tests/bench/test_bench_tune_attention.py")
        out, tuned = self.out / "tune.json", ROOT / "kernels" / "triton_tuned.json"
        result = self.bench("tune", [sys.executable, "bench/compute/tune_attention.py", "--write", str(tuned),
                                     "--json", str(out)], out, limit)
        if result.status == "passed":  # the file to commit beside every timing; the winners in the report
            shutil.copy(tuned, self.out / tuned.name)
            result.results = {k: {m: r[m] for m in ("winner", "winner_mean", "default_mean")}
                              for k, r in result.results["results"].items()}
        return result

    def fleet(self, limit: float) -> StepResult:
        runs, results = FLEET_RUNS if self.cuda else FLEET_RUNS_CPU, {}
        deadline = time.monotonic() + limit
        for name, argv in runs.items():
            needs = sum(float(argv[argv.index(flag) + 1]) for flag in ("--duration", "--baseline-duration")
                        if flag in argv) + FLEET_START_S
            if deadline - time.monotonic() < needs:
                results[name] = "skipped: no time left in the budget"
                continue
            out = self.work / f"fleet-{name}.json"
            out.unlink(missing_ok=True)
            one = [r["one_worker_tokens_per_s"] for r in results.values() if isinstance(r, dict)
                   and r.get("one_worker_tokens_per_s")
                   and r["step_model"]["step_ms"] == float(argv[argv.index("--step-ms") + 1])]
            if "--baseline-duration" in argv and argv[argv.index("--baseline-duration") + 1] == "0" and one:
                argv = [*argv, "--one-worker-tokens-per-s", str(one[-1])]
            code = self.run([sys.executable, "bench/stack/fleet.py", *argv, "--run-dir", str(self.work / "fleet"),
                             "--json", str(out)], max(1.0, deadline - time.monotonic()))
            results[name] = json.loads(out.read_text()) if code == 0 and out.exists() else f"exit {code}"
        failed = [n for n, r in results.items() if isinstance(r, str) and not r.startswith("skipped")]
        skipped = [n for n, r in results.items() if isinstance(r, str) and r.startswith("skipped")]
        reason = "; ".join(filter(None, [f"{', '.join(failed)} did not finish" if failed else "",
                                         f"no time left for {', '.join(skipped)}" if skipped else ""]))
        status = "failed" if failed else "skipped" if len(skipped) == len(results) else "passed"
        return StepResult("fleet", status, reason=reason, results=results)

    def serving(self, limit: float) -> StepResult:
        out = self.out / "serving.json"
        preset = "1b" if self.cuda else "tiny"
        cmd = [sys.executable, ".ci/gpu/serving.py", "--device", self.args.device, "--preset", preset,
               "--tokenizer", str(self.args.bundle / "tokenizers" / f"llama-{preset}"),
               "--work", str(self.work / "serving"), "--json", str(out)]
        if not self.cuda:
            cmd += ["--concurrency", "4", "8", "--output-mean", "16", "--roofline-batches", "4"]
        elif self.args.serving_concurrency is not None:
            cmd += ["--concurrency", *map(str, self.args.serving_concurrency)]
        return self.bench("serving", cmd, out, limit, "" if self.cuda else "tiny preset on the CPU")

    def cameras(self, limit: float) -> StepResult:
        out = self.out / "cameras.json"
        cmd = [sys.executable, ".ci/gpu/camera_serving.py", "--device", self.args.device,
               "--budget-s", str(max(30.0, limit - 45)), "--work", str(self.work / "cameras"), "--json", str(out)]
        return self.bench("cameras", cmd, out, limit, "" if self.cuda else "tiny preset on the CPU")


def junit_summary(xml: Path) -> dict:
    """Counts and the failed tests (id and the first line of the failure) of a junit file."""
    suites = ET.parse(xml).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    results = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": message[0][:400] if message else ""})
    results["failed"] = failed
    return results


def machine(env: dict) -> dict:
    """The device and the packages found (as this environment sees them)."""
    probe = ("import json, platform, importlib.metadata as m, torch\n"
             "d = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda,\n"
             "     'device': torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu',\n"
             "     'packages': sorted(f\"{x.metadata['Name']}=={x.version}\" for x in m.distributions())}\n"
             "print(json.dumps(d))")
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    info = json.loads(found.stdout) if found.returncode == 0 else {"error": found.stderr[-500:]}
    info.update(host=platform.node(), cpus=os.cpu_count())
    return info


def print_summary(report: dict, say) -> None:
    say(f"\nmachine: {report['machine'].get('device')} (torch {report['machine'].get('torch')}, "
        f"CUDA {report['machine'].get('cuda')}, Python {report['machine'].get('python')})")
    for s in report["steps"]:
        say(f"  {s['name']:8s} {s['status']:8s} {s['seconds']:6.0f} s  {s['reason']}")
    say(f"total {report['seconds']:.0f} s; details in gpu-check.json and gpu-check.log")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-out"))
    p.add_argument("--work", type=Path, default=Path("/tmp/pagedserve-gpu-check"))
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run, every step included")
    p.add_argument("--limit-scale", type=float, default=None,
                   help="multiply each step's own limit (default: 1 on CUDA, 6 on the CPU)")
    p.add_argument("--steps", nargs="+", default=[s for s in LIMITS if s != "cameras"], choices=list(LIMITS),
                   help="default: all but cameras, which needs a draw of its own (--steps install cameras)")
    p.add_argument("--serving-concurrency", type=int, nargs="*", default=None,
                   help="the serving step's concurrencies (default 256 64; none: decode steps and the mixed step only)")
    p.add_argument("--kernels-baseline", type=Path, default=None,
                   help="another revision's kernels/triton_attention.py, timed beside this tree's in the kernels step")
    p.add_argument("--test-workers", type=int, default=4, help="pytest-xdist processes for the GPU tests")
    args = p.parse_args(argv)
    if args.limit_scale is None:
        args.limit_scale = 1.0 if args.device == "cuda" else 6.0
    if args.device == "cpu" and args.budget_s == 480.0:
        args.budget_s = 3600.0  # the CPU dry run has no lease to fit in
    args.bundle, args.out = args.bundle.resolve(), args.out.resolve()
    check = Check(args)
    t0 = time.monotonic()
    steps = []
    for name in args.steps:
        if name != "install" and steps and steps[0].name == "install" and steps[0].status != "passed":
            steps.append(StepResult(name, "skipped", reason="the install step failed"))
            continue
        steps.append(check.step(name, getattr(check, name)))
    report = {"device": args.device, "machine": machine(check.env), "steps": [asdict(s) for s in steps],
              "seconds": round(time.monotonic() - t0, 1)}
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    print_summary(report, check.say)
    return 0 if all(s.status in ("passed", "skipped") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
