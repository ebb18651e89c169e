"""The compose file describes the same stack as the local launcher, and it validates."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from compose.cli import build_parser

COMPOSE = Path(__file__).resolve().parent.parent / "compose" / "docker-compose.yml"


@pytest.fixture(scope="module")
def config() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `make test` installs it (Debian package docker-compose)")
    out = subprocess.run([binary, "-f", str(COMPOSE), "config"], check=True, capture_output=True, text=True)
    return yaml.safe_load(out.stdout)


def test_services_present(config):
    assert {"redis", "gateway", "scheduler", "worker", "make-model"} <= set(config["services"])


def test_workers_reserve_a_gpu_and_scale(config):
    worker = config["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "container_name" not in worker and "ports" not in worker  # or --scale would clash


@pytest.mark.parametrize("service", ["gateway", "scheduler", "worker"])
def test_commands_are_the_launchers(config, service, monkeypatch):
    """Each container runs a `pagedserve <service>` command line our own CLI accepts."""
    spec = config["services"][service]
    for key, value in spec["environment"].items():
        monkeypatch.setenv(key, str(value))
    args = build_parser().parse_args(spec["command"])
    assert args.command == service
    assert args.redis_url == "redis://redis:6379/0"
    if service != "scheduler":
        assert args.model.startswith("/models/")


def test_preemption_and_swap_flags_parse():
    from compose.cli import build_parser

    args = build_parser().parse_args(["scheduler", "--preemption-mode", "swap"])
    assert args.preemption_mode == "swap"
    assert build_parser().parse_args(["scheduler"]).preemption_mode == "recompute"
    args = build_parser().parse_args(["worker", "--model", "m", "--swap-space", "1GiB"])
    assert args.swap_space == 2**30
    assert build_parser().parse_args(["worker", "--model", "m"]).swap_space == 256 * 2**20
    with pytest.raises(SystemExit):
        build_parser().parse_args(["scheduler", "--preemption-mode", "never"])
