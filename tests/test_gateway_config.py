"""GatewayConfig and its argparse helpers."""

import argparse

from gateway.config import GatewayConfig, add_cli_args, config_from_args


def test_cli_args_env_and_defaults(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_REQUEST_TIMEOUT_S", "7.5")
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default="redis://elsewhere:6379/0")  # the CLI's own flag
    add_cli_args(parser)  # skips --redis-url instead of clashing with it
    args = parser.parse_args(["--model", "/models/small/", "--port", "9000", "--api-key", "k"])
    config = config_from_args(args)
    assert config == GatewayConfig(model="/models/small/", port=9000, api_keys=("k",), request_timeout_s=7.5,
                                   redis_url="redis://elsewhere:6379/0")
    assert config.model_name == "small"
    assert GatewayConfig(model="/m/x", served_model_name="y").model_name == "y"


def test_model_flag_required_unless_in_env(monkeypatch):
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert parser._option_string_actions["--model"].required
    monkeypatch.setenv("PAGEDSERVE_MODEL", "/m/tiny")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_from_args(parser.parse_args([])).model == "/m/tiny"


def test_api_keys_from_flags_and_env(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_API_KEYS", "a, b,,c")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "z")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = config_from_args(parser.parse_args(["--model", "m", "--api-key", "d", "--api-key", "a"]))
    assert config.api_keys == ("z", "a", "b", "c", "d")
    assert not config.protect_metrics
    monkeypatch.setenv("PAGEDSERVE_PROTECT_METRICS", "1")
    monkeypatch.delenv("PAGEDSERVE_API_KEYS")
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    config = config_from_args(parser.parse_args(["--model", "m"]))
    assert config.api_keys == () and config.protect_metrics
