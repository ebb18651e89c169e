"""The gateway's configuration: one frozen dataclass, plus argparse helpers to build it."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

ENV_PREFIX = "PAGEDSERVE_"


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # checkpoint folder: tokenizer files and chat template
    served_model_name: str | None = None  # name clients send as `model`; default: folder name
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    host: str = "127.0.0.1"
    port: int = 8000
    # When any is set, every /v1 route wants `Authorization: Bearer <one of them>`.
    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False  # /metrics (and /health) want a key too
    max_body_bytes: int = 8 * 2**20  # larger bodies get 413 before they are parsed
    # /v1/completions without max_tokens gets 16, like OpenAI's legacy endpoint; chat without
    # it may use the whole context left after the prompt.
    default_max_tokens: int = 16
    # Longest wait for the next token event of a request; then it is aborted with 504. It is
    # a gap between events, not a total, so long generations are fine as long as they move.
    request_timeout_s: float = 600.0
    worker_cache_ttl_s: float = 1.0  # how long the list of live workers is reused

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name


# flag → (GatewayConfig field, type, help). `model` is the only required one.
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "checkpoint folder (tokenizer, chat template)"),
    "--served-model-name": ("served_model_name", str, "name clients use (default: the folder's name)"),
    "--redis-url": ("redis_url", str, "Redis the services meet in"),
    "--key-prefix": ("key_prefix", str, "prefix of every Redis key"),
    "--host": ("host", str, "HTTP bind address"),
    "--port": ("port", int, "HTTP port"),
    "--max-body-bytes": ("max_body_bytes", int, "largest accepted request body"),
    "--default-max-tokens": ("default_max_tokens", int, "max_tokens of /v1/completions when absent"),
    "--request-timeout-s": ("request_timeout_s", float, "longest wait for the next token event"),
    "--worker-cache-ttl-s": ("worker_cache_ttl_s", float, "seconds the live-worker list is cached"),
}


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add every gateway flag the parser does not have yet (so it composes with a CLI that
    already defines shared flags such as --redis-url). Each flag also reads PAGEDSERVE_<FLAG>
    from the environment; the flag wins."""
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    existing = set(parser._option_string_actions)  # argparse has no public "has flag" query
    for flag, (field, kind, help_text) in _FLAGS.items():
        if flag in existing:
            continue
        env = os.environ.get(_env_name(flag))
        default = kind(env) if env is not None else defaults.get(field)
        if default is dataclasses.MISSING:
            default = None
        required = field == "model" and default is None
        parser.add_argument(flag, type=kind, default=default, required=required,
                            help=f"{help_text} (env {_env_name(flag)})")
    if "--api-key" not in existing:
        # Flags add to the keys from the environment: any of them is accepted.
        parser.add_argument("--api-key", action="append", default=_keys_from_env(),
                            help="require `Authorization: Bearer <key>` on /v1 routes; repeat for "
                                 "several keys (env PAGEDSERVE_API_KEY, or PAGEDSERVE_API_KEYS=k1,k2)")
    if "--protect-metrics" not in existing:
        parser.add_argument("--protect-metrics", action="store_true",
                            default=os.environ.get(ENV_PREFIX + "PROTECT_METRICS", "").lower() in ("1", "true", "yes"),
                            help="with API keys, /metrics and /health want a key too "
                                 "(env PAGEDSERVE_PROTECT_METRICS=1)")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """GatewayConfig from parsed args; fields the namespace lacks keep their defaults."""
    values = {field: getattr(args, field) for field, _, _ in _FLAGS.values()
              if getattr(args, field, None) is not None}
    keys = tuple(getattr(args, "api_key", None) or ())
    values["api_keys"] = tuple(dict.fromkeys(k for k in keys if k))  # no duplicates, order kept
    values["protect_metrics"] = bool(getattr(args, "protect_metrics", False))
    return GatewayConfig(**values)


def _keys_from_env() -> list[str]:
    """PAGEDSERVE_API_KEY (one key) and PAGEDSERVE_API_KEYS (several, comma-separated)."""
    keys = [os.environ.get(ENV_PREFIX + "API_KEY", "")]
    keys += os.environ.get(ENV_PREFIX + "API_KEYS", "").split(",")
    return [k.strip() for k in keys if k.strip()]
