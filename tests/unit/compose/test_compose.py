"""The compose file describes the same stack as the local launcher, and it validates."""

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from compose import commands
from compose.cli import COMMANDS, build_parser, main
from proto.metrics import EncoderRecorder, StepCollector, StepRecorder
from proto.metrics_scrape import parse_samples
from tests.e2e.test_compose_stack import DASHBOARD, README_COMMANDS, images_row_metrics

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = ROOT / "compose" / "docker-compose.yml"


def rendered(*files: Path, **env: str) -> dict:
    """The configuration compose makes of these files, one overriding the other, with the
    variables the base file reads at their defaults but for `env`."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `make test` installs it (Debian package docker-compose)")
    read = set(re.findall(r"\$\{(\w+)", COMPOSE.read_text()))
    environ = {k: v for k, v in os.environ.items() if k not in read}
    out = subprocess.run([binary, *(a for f in files for a in ("-f", str(f))), "config"], check=True,
                         capture_output=True, text=True, env={**environ, **env})
    return yaml.safe_load(out.stdout)


@pytest.fixture(scope="module")
def config() -> dict:
    return rendered(COMPOSE)


@pytest.fixture(scope="module")
def gpu_config(tmp_path_factory) -> dict:
    """The override `pagedserve compose-gpu --gpus 0,1,3` prints, rendered over the base file."""
    override = tmp_path_factory.mktemp("gpu") / "docker-compose.gpu.yml"
    with override.open("w") as out, contextlib.redirect_stdout(out):
        assert main(["compose-gpu", "--gpus", "0,1,3", "--gpu-memory-utilization", "0.8"]) == 0
    return rendered(COMPOSE, override)


def test_services_present(config):
    assert {"redis", "gateway", "scheduler", "worker", "encoder", "make-model", "prometheus",
            "grafana"} <= set(config["services"])


def test_cpu_workers_by_default_and_they_scale(config):
    worker = config["services"]["worker"]
    assert "deploy" not in worker  # no GPU reservation: `up` works on a machine without one
    assert worker["command"][worker["command"].index("--device") + 1] == "cpu"
    assert "container_name" not in worker and "ports" not in worker  # or --scale would clash


def test_gateways_scale_on_a_range_of_host_ports(config):
    (port,) = config["services"]["gateway"]["ports"]
    published = str(port["published"]) if isinstance(port, dict) else port.rsplit(":", 1)[0]
    assert "-" in published  # each replica takes a free port of the range, none is fixed


def test_light_image_for_gateway_and_scheduler_worker_image_for_the_model(config):
    services = config["services"]
    for name in ("gateway", "scheduler"):
        assert services[name]["build"]["target"] == "light" and "light" in services[name]["image"]
    for name in ("worker", "make-model", "encoder"):
        assert services[name]["build"]["target"] == "worker" and "worker" in services[name]["image"]
    assert services["worker"]["build"]["args"]["BASE_IMAGE"] == "python:3.11-slim"


def test_every_long_running_service_has_a_healthcheck_and_restarts(config):
    for name, spec in config["services"].items():
        if name == "make-model":
            assert spec["restart"] == "no"
            continue
        assert spec["healthcheck"]["test"][0] == "CMD", name
        assert spec["restart"] == "unless-stopped", name
    assert config["services"]["prometheus"]["profiles"] == ["monitoring"]
    assert config["services"]["grafana"]["profiles"] == ["monitoring"]
    assert config["services"]["encoder"]["profiles"] == ["encoder"]


@pytest.mark.parametrize("service", ["worker", "gateway"])
def test_containers_get_longer_than_their_drain_to_stop(config, service, monkeypatch):
    """Docker SIGKILLs a container stop_grace_period after SIGTERM (10 s when unset): it
    must outlast the service's --drain-timeout, or the drain is cut."""
    grace = config["services"][service]["stop_grace_period"]
    assert grace.endswith("s") and grace[:-1].isdigit(), grace
    assert int(grace[:-1]) > _args(config, service, monkeypatch).drain_timeout + 5


def _args(config: dict, service: str, monkeypatch):
    """The service's command as our CLI parses it, in the container's environment."""
    spec = config["services"][service]
    for key, value in spec["environment"].items():
        monkeypatch.setenv(key, str(value))
    return build_parser().parse_args(spec["command"])


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker", "encoder"])
def test_commands_are_the_launchers(config, service, monkeypatch):
    """Each container runs a `pagedserve <service>` command line our own CLI accepts."""
    args = _args(config, service, monkeypatch)
    assert args.command == service
    assert args.redis_url == "redis://redis:6379/0"
    if service != "scheduler":
        assert args.model.startswith("/models/")


def test_every_command_is_in_the_table(capsys):
    assert {"up", "gateway", "scheduler", "worker", "encoder", "engine", "bench", "make-model",
            "compose-gpu"} == set(COMMANDS)
    assert COMMANDS["worker"].run is commands.run_worker
    assert main(["bench", "--help"]) == 0  # dispatched through the table to bench/stack/serve.py
    assert "--base-url" in capsys.readouterr().out


def test_the_encoder_is_opt_in_scalable_and_probed_on_its_health(config, monkeypatch):
    """`--profile encoder` only (the default MODEL is a text checkpoint, which an encoder
    refuses); on the CPU, the workers' model, its threads from its CPU limit; no fixed
    name or host port (`--scale encoder=N`); its healthcheck is its own /health."""
    encoder = config["services"]["encoder"]
    assert encoder["profiles"] == ["encoder"]
    assert "container_name" not in encoder and "ports" not in encoder and "deploy" not in encoder
    args = _args(config, "encoder", monkeypatch)
    assert args.device == "cpu" and args.host == "0.0.0.0" and args.metrics_port and args.dtype == "auto"
    assert args.model == config["services"]["worker"]["environment"]["PAGEDSERVE_MODEL"]
    assert args.threads is None and float(encoder["cpus"]) >= 1  # threads: the cgroup quota (modeling/cpu_threads.py)
    assert encoder["depends_on"] == {"redis": {"condition": "service_healthy"},
                                     "make-model": {"condition": "service_completed_successfully"}}
    probe = encoder["healthcheck"]["test"]
    assert probe[:3] == ["CMD", "python3", "-c"] and f"127.0.0.1:{args.metrics_port}/health" in probe[3]
    assert encoder["restart"] == "unless-stopped"


def test_make_model_writes_the_arch_and_preset_asked_for(monkeypatch):
    """ARCH and PRESET reach `pagedserve make-model` (a vision MODEL for the encoders)."""
    for env, (arch, preset) in (({}, ("llama", "small")),
                                ({"MODEL": "v", "ARCH": "gemma3-vision", "PRESET": "tiny"}, ("gemma3-vision", "tiny"))):
        (script,) = rendered(COMPOSE, **env)["services"]["make-model"]["command"]
        model = f"/models/{env.get('MODEL', 'small')}"
        assert script.startswith(f"test -f {model}/config.json || pagedserve ")
        args = build_parser().parse_args(script.split("|| pagedserve ", 1)[1].split())
        assert (args.command, args.dir, args.arch, args.preset) == ("make-model", model, arch, preset)


def test_preemption_and_swap_flags_parse():
    args = build_parser().parse_args(["scheduler", "--preemption-mode", "swap"])
    assert args.preemption_mode == "swap"
    assert build_parser().parse_args(["scheduler"]).preemption_mode == "recompute"
    args = build_parser().parse_args(["worker", "--model", "m", "--swap-space", "1GiB"])
    assert args.swap_space == 2**30
    assert build_parser().parse_args(["worker", "--model", "m"]).swap_space == 256 * 2**20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--preemption-mode", "never"])


def test_prometheus_scrapes_every_service_where_it_serves_metrics(config, monkeypatch):
    prometheus = config["services"]["prometheus"]
    assert any(v.endswith(":/etc/prometheus/prometheus.yml:ro") for v in _volumes(prometheus))
    jobs = {job["job_name"]: job for job in yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
            ["scrape_configs"]}
    assert set(jobs) == {"gateway", "scheduler", "worker", "encoder"}
    gateway, scheduler = _args(config, "gateway", monkeypatch), _args(config, "scheduler", monkeypatch)
    worker, encoder = _args(config, "worker", monkeypatch), _args(config, "encoder", monkeypatch)
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway.port}"]
    assert jobs["scheduler"]["static_configs"][0]["targets"] == [f"scheduler:{scheduler.metrics_port}"]
    assert scheduler.metrics_port and scheduler.metrics_host == "0.0.0.0"
    (workers,) = jobs["worker"]["dns_sd_configs"]  # every replica of --scale worker=N
    assert workers["names"] == ["worker"] and workers["port"] == worker.metrics_port and worker.host == "0.0.0.0"
    (encoders,) = jobs["encoder"]["dns_sd_configs"]  # every replica of --scale encoder=N
    assert encoders["names"] == ["encoder"] and encoders["port"] == encoder.metrics_port
    assert encoder.host == "0.0.0.0"


def _volumes(spec: dict) -> list[str]:
    """docker-compose config writes volumes as "src:dst:mode" strings or as mappings."""
    return [v if isinstance(v, str) else f"{v['source']}:{v['target']}{':ro' if v.get('read_only') else ''}"
            for v in spec.get("volumes", [])]


def test_grafana_provisions_the_dashboard_on_prometheus(config):
    grafana = config["services"]["grafana"]
    mounts = dict(v.rsplit(":", 2)[:2] for v in _volumes(grafana))
    for source in mounts:
        assert Path(source).is_file(), source
    datasource_file = next(s for s, t in mounts.items() if "/provisioning/datasources/" in t)
    (datasource,) = yaml.safe_load(Path(datasource_file).read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    dashboard_file = next(s for s, t in mounts.items() if t.startswith("/var/lib/grafana/dashboards/"))
    provider = yaml.safe_load(Path(next(s for s, t in mounts.items() if "/provisioning/dashboards/" in t))
                              .read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(Path(dashboard_file).read_text())
    every = _all_panels(dashboard)
    panels = [p for p in every if p["type"] != "row"]
    assert len({p["id"] for p in every}) == len(every)
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource["uid"] and panel["targets"], panel["title"]
    # Its job variables default to the scrape jobs of prometheus.yml.
    jobs = {job["job_name"] for job in yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
            ["scrape_configs"]}
    defaults = {v["name"]: v["current"]["value"] for v in dashboard["templating"]["list"]}
    assert defaults == {"gateway_job": "gateway", "scheduler_job": "scheduler", "worker_job": "worker",
                        "encoder_job": "encoder"}
    assert set(defaults.values()) == jobs


def _all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included (Grafana nests them there)."""
    return [q for p in dashboard["panels"] for q in (p, *p.get("panels", []))]


def _exported(*collectors) -> set[str]:
    """The sample names these collectors put on a /metrics page."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return {name for name, _ in parse_samples(generate_latest(registry).decode())}


def test_the_images_row_queries_what_vision_workers_and_encoders_export():
    """The collapsed images row (vision models only, so the text-model stack of
    tests/e2e/test_e2e_metrics.py does not check it): each expression names metrics that a
    vision worker's own /metrics (its steps and its images) or an encoder's exports."""
    from encoder_svc.service import _Collector  # torch: only this test loads it
    from proto.encoder_messages import EncoderStats

    stats = EncoderStats("e", EncoderRecorder().snapshot())
    names = {"worker": _exported(StepCollector("w", StepRecorder(), EncoderRecorder())),
             "encoder": _exported(_Collector("e", lambda: stats, lambda: 0))}
    (row,) = [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"].startswith("Images")]
    assert row["type"] == "row" and row["collapsed"] and len(row["panels"]) >= 6
    used = set()
    for title, job, metric in images_row_metrics():
        assert metric in names[job], f"panel {title!r}: {job} does not export {metric}"
        used.add((job, metric))
    assert {("worker", "pagedserve:mm_cache_hits_total"), ("encoder", "pagedserve:encoder_queue_depth"),
            ("worker", "pagedserve:step_duration_seconds_sum"), ("encoder", "pagedserve:mm_items_encoded_total"),
            ("worker", "pagedserve:mm_items_encoded_total")} <= used


def test_gpu_variant_gives_each_worker_its_own_gpu(gpu_config, monkeypatch):
    services = gpu_config["services"]
    gpu_workers = sorted(name for name in services if name.startswith("worker-gpu"))
    assert gpu_workers == ["worker-gpu0", "worker-gpu1", "worker-gpu3"]
    device_ids = []
    for name in gpu_workers:
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        device_ids.append(device["device_ids"])
        args = _args(gpu_config, name, monkeypatch)
        assert args.command == "worker" and args.device == "cuda" and args.gpu_memory_utilization == 0.8
        assert "worker" in services[name]["networks"]["default"]["aliases"]  # Prometheus finds them
        assert services[name]["build"]["args"]["TORCH_INDEX"].endswith("/whl/cu128")
        assert services[name]["healthcheck"] == services["worker"]["healthcheck"]
    assert device_ids == [["0"], ["1"], ["3"]]
    assert services["worker"]["deploy"]["replicas"] == 0  # the CPU worker (or --scale worker=0)


@pytest.mark.parametrize("gpus", ["", "0,0", "a,b", "1,x"])
def test_gpu_ids_are_a_count_or_distinct_ids(gpus):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compose-gpu", "--gpus", gpus])
    assert build_parser().parse_args(["compose-gpu", "--gpus", "2"]).gpus == ["0", "1"]


def test_the_readme_commands_are_the_ones_make_test_compose_runs():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Docker\n\n```bash\n", 1)[1].split("```", 1)[0]
    prefix = "docker compose -f compose/docker-compose.yml "
    lines = block.strip().splitlines()
    assert all(line.startswith(prefix) for line in lines), lines
    assert [tuple(line[len(prefix):].split()) for line in lines] == README_COMMANDS
