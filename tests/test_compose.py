"""The compose file describes the same stack as the local launcher, and it validates."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from compose import commands
from compose.cli import COMMANDS, build_parser, main

COMPOSE = Path(__file__).resolve().parent.parent / "compose" / "docker-compose.yml"


@pytest.fixture(scope="module")
def config() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `make test` installs it (Debian package docker-compose)")
    out = subprocess.run([binary, "-f", str(COMPOSE), "config"], check=True, capture_output=True, text=True)
    return yaml.safe_load(out.stdout)


def test_services_present(config):
    assert {"redis", "gateway", "scheduler", "worker", "make-model", "prometheus", "grafana"} <= set(config["services"])


def test_workers_reserve_a_gpu_and_scale(config):
    worker = config["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "container_name" not in worker and "ports" not in worker  # or --scale would clash


def _args(config: dict, service: str, monkeypatch):
    """The service's command as our CLI parses it, in the container's environment."""
    spec = config["services"][service]
    for key, value in spec["environment"].items():
        monkeypatch.setenv(key, str(value))
    return build_parser().parse_args(spec["command"])


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker"])
def test_commands_are_the_launchers(config, service, monkeypatch):
    """Each container runs a `pagedserve <service>` command line our own CLI accepts."""
    args = _args(config, service, monkeypatch)
    assert args.command == service
    assert args.redis_url == "redis://redis:6379/0"
    if service != "scheduler":
        assert args.model.startswith("/models/")


def test_every_command_is_in_the_table(capsys):
    assert {"up", "gateway", "scheduler", "worker", "engine", "bench", "make-model"} == set(COMMANDS)
    assert COMMANDS["worker"].run is commands.run_worker
    assert main(["bench", "--help"]) == 0  # dispatched through the table to bench/serve.py
    assert "--base-url" in capsys.readouterr().out


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
    assert set(jobs) == {"gateway", "scheduler", "worker"}
    gateway, scheduler = _args(config, "gateway", monkeypatch), _args(config, "scheduler", monkeypatch)
    worker = _args(config, "worker", monkeypatch)
    assert jobs["gateway"]["static_configs"][0]["targets"] == [f"gateway:{gateway.port}"]
    assert jobs["scheduler"]["static_configs"][0]["targets"] == [f"scheduler:{scheduler.metrics_port}"]
    assert scheduler.metrics_port and scheduler.metrics_host == "0.0.0.0"
    (workers,) = jobs["worker"]["dns_sd_configs"]  # every replica of --scale worker=N
    assert workers["names"] == ["worker"] and workers["port"] == worker.metrics_port and worker.host == "0.0.0.0"


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
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == datasource["uid"] and panel["targets"], panel["title"]
    # Its job variables default to the scrape jobs of prometheus.yml.
    jobs = {job["job_name"] for job in yaml.safe_load((COMPOSE.parent / "prometheus.yml").read_text())
            ["scrape_configs"]}
    defaults = {v["name"]: v["current"]["value"] for v in dashboard["templating"]["list"]}
    assert defaults == {"gateway_job": "gateway", "scheduler_job": "scheduler", "worker_job": "worker"}
    assert set(defaults.values()) == jobs
