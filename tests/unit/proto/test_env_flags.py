"""proto/env_flags.py: the one mapping from flags to PAGEDSERVE_* environment variables."""

import argparse

import pytest

from compose.flags import parse_bytes
from proto.env_flags import EnvFlags, env_name


def flags(**environ: str) -> EnvFlags:
    return EnvFlags(argparse.ArgumentParser(), environ=environ)


def test_names():
    assert env_name("--kv-cache-memory") == "PAGEDSERVE_KV_CACHE_MEMORY"
    assert env_name("--max-num-seqs") == "PAGEDSERVE_MAX_NUM_SEQS"


def test_flag_wins_over_environment_over_default():
    f = flags(PAGEDSERVE_PORT="9000", PAGEDSERVE_SWAP_SPACE="1GiB")
    f.add("--port", type=int, default=8000)
    f.add("--host", default="127.0.0.1")
    f.add("--swap-space", type=parse_bytes, default="256MiB")
    args = f.parser.parse_args([])
    assert (args.port, args.host, args.swap_space) == (9000, "127.0.0.1", 2**30)  # converted by `type`
    args = f.parser.parse_args(["--port", "7000", "--host", "0.0.0.0", "--swap-space", "2KiB"])
    assert (args.port, args.host, args.swap_space) == (7000, "0.0.0.0", 2048)
    assert "(env PAGEDSERVE_PORT)" in f.parser.format_help()


def test_bad_environment_value_is_reported_like_a_bad_flag(capsys):
    f = flags(PAGEDSERVE_PORT="eighty")
    f.add("--port", type=int, default=8000)
    with pytest.raises(SystemExit):
        f.parser.parse_args([])
    assert "invalid int value: 'eighty'" in capsys.readouterr().err
    f = flags(PAGEDSERVE_MODE="never")
    with pytest.raises(SystemExit):
        f.add("--mode", default="a", choices=["a", "b"])
    assert "PAGEDSERVE_MODE='never'" in capsys.readouterr().err


def test_required_unless_the_environment_gives_it(capsys):
    f = flags()
    f.add("--model", required=True)
    with pytest.raises(SystemExit):
        f.parser.parse_args([])
    assert "required: --model" in capsys.readouterr().err
    f = flags(PAGEDSERVE_MODEL="/m")
    f.add("--model", required=True)
    assert f.parser.parse_args([]).model == "/m"


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False)])
def test_switch(value, on):
    f = flags(PAGEDSERVE_NO_PREFIX_CACHING=value)
    f.switch("--no-prefix-caching")
    assert f.parser.parse_args([]).no_prefix_caching is on
    assert f.parser.parse_args(["--no-prefix-caching"]).no_prefix_caching is True


def test_repeated_takes_one_and_several_from_the_environment_first():
    f = flags(PAGEDSERVE_API_KEY="z", PAGEDSERVE_API_KEYS="a, b,,c")
    f.repeated("--api-key")
    assert f.parser.parse_args(["--api-key", "d"]).api_key == ["z", "a", "b", "c", "d"]
    assert f.parser.parse_args([]).api_key == ["z", "a", "b", "c"]


def test_first_definition_wins():
    """Shared groups of flags compose: the second definition of a flag is skipped."""
    f = flags()
    f.add("--redis-url", default="redis://first")
    f.add("--redis-url", default="redis://second")  # argparse alone would raise a conflict
    f.switch("--protect-metrics")
    f.switch("--protect-metrics")
    assert f.parser.parse_args([]).redis_url == "redis://first"


def test_the_scheduler_step_timeout_reaches_its_config():
    from compose.cli import build_parser
    from compose.commands import scheduler_service_config

    parser = build_parser()
    assert scheduler_service_config(parser.parse_args(["scheduler"])).step_timeout_s == 120.0
    args = parser.parse_args(["scheduler", "--step-timeout", "900"])  # a 4B's image step on 2 cores
    assert scheduler_service_config(args).step_timeout_s == 900.0
