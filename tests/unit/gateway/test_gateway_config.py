"""GatewayConfig and its argparse helpers."""

import argparse

import pytest

from gateway.config import GatewayConfig, add_cli_args, config_from_args
from proto.env_flags import EnvFlags


def gateway_parser(*shared: tuple[str, str]) -> argparse.ArgumentParser:
    """A parser with the gateway's flags, after the command's own `(flag, default)`s."""
    flags = EnvFlags(argparse.ArgumentParser())
    for flag, default in shared:
        flags.add(flag, default=default)
    add_cli_args(flags)
    return flags.parser


def test_cli_args_env_and_defaults(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REQUEST_TIMEOUT_S", "7.5")
    # The command's own --redis-url comes first; the gateway's is skipped, not clashing with it.
    parser = gateway_parser(("--redis-url", "redis://elsewhere:6379/0"))
    args = parser.parse_args(["--model", "/models/small/", "--port", "9000", "--api-key", "k",
                              "--drain-timeout", "2.5"])
    config = config_from_args(args)
    assert config == GatewayConfig(model="/models/small/", port=9000, api_keys=("k",), request_timeout_s=7.5,
                                   redis_url="redis://elsewhere:6379/0", drain_timeout_s=2.5)
    assert config.model_name == "small"
    assert GatewayConfig(model="/m/x", served_model_name="y").model_name == "y"


def test_model_flag_required_unless_in_env(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        gateway_parser().parse_args([])
    assert "the following arguments are required: --model" in capsys.readouterr().err
    monkeypatch.setenv("PAGEDSERVE_MODEL", "/m/tiny")
    assert config_from_args(gateway_parser().parse_args([])).model == "/m/tiny"


def test_api_keys_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEYS", "a, b,,c")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "z")
    config = config_from_args(gateway_parser().parse_args(["--model", "m", "--api-key", "d", "--api-key", "a"]))
    assert config.api_keys == ("z", "a", "b", "c", "d")
    assert not config.protect_metrics
    monkeypatch.setenv("PAGEDSERVE_PROTECT_METRICS", "1")
    monkeypatch.delenv("PAGEDSERVE_API_KEYS")
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    config = config_from_args(gateway_parser().parse_args(["--model", "m"]))
    assert config.api_keys == () and config.protect_metrics
