"""The gateway's configuration: one frozen dataclass, plus argparse helpers to build it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.media.address_policy import networks_arg, parse_networks  # stdlib-only too
from gateway.media.options import limits_arg, media_io_kwargs_arg  # stdlib-only too
from gateway.tool_parsers import TOOL_PARSERS  # stdlib-only, like this module
from proto.env_flags import EnvFlags
from proto.model_source import served_name, served_names

TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # checkpoint folder or Hub id (proto/model_source.py): tokenizer files, chat template
    # names clients send as `model`, comma-separated; the first is reported and is the one
    # workers register under. Default: the folder's name, or the Hub id.
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja file (or the template itself) replacing the model's
    generation_config: str = "auto"  # sampling defaults: auto | vllm | FOLDER (gateway/sampling_defaults.py)
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
    # A stream whose client leaves this many token events per sequence unread (its socket
    # full) is aborted and its blocks freed: the gateway's memory per stream stays bounded
    # (gateway/event_queues.py).
    max_unread_events: int = 4096
    # SIGTERM: stop taking connections, let open requests and streams finish for at most this
    # long, then close what is left.
    drain_timeout_s: float = 30.0
    # An idle keep-alive connection is closed after this long. Longer than clients keep idle
    # connections (httpx and the openai client: 5 s, aiohttp: 15 s, nginx upstreams: 60 s), so
    # the client always drops one first: when both sides wait 5 s (uvicorn's default), a request
    # sent on a connection the server is closing meets a reset (httpx.ReadError).
    timeout_keep_alive_s: float = 75.0
    # Tool calls (gateway/tools.py): the parser of the model's call format, by vLLM's name,
    # and whether an absent or "auto" tool_choice lets the model decide.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # Media in chat content parts (gateway/media/): images and video fetched, checked and
    # stored in Redis by content hash. vLLM's flags, with vLLM's JSON syntax
    # (gateway/media/options.py).
    limit_mm_per_prompt: str = '{"image": 8, "video": 1}'  # most items of each kind per prompt
    media_io_kwargs: str = '{"video": {"num_frames": 32}}'  # video sampling: num_frames, fps
    # Local files (file:// URLs or paths) are read only below this folder; None: refused.
    allowed_local_media_path: str | None = None
    # http(s) media only from these host names (exact match); empty: from any host.
    allowed_media_domains: tuple[str, ...] = ()
    # Networks (CIDRs) whose non-public addresses http(s) media may come from: by default a
    # host that resolves to loopback, private, link-local, ... addresses is refused, listed
    # domain or not (gateway/media/address_policy.py).
    allowed_media_networks: tuple[str, ...] = ()
    media_fetch_timeout_s: float = 10.0  # the whole fetch of one URL, redirects included
    max_media_bytes: int = 20 * 2**20  # one image or video file, however it arrives
    max_image_pixels: int = 2**25  # width * height of an image or a video frame (~33.5 MP)
    max_video_frames: int = 9000  # frames in a video, before sampling (5 min at 30 fps)
    media_ttl_s: float = 3600.0  # stored media expire this long after their last use
    # The Files API (gateway/files/): an uploaded file lives this long (a client may ask for
    # less), and all stored files together take at most this many bytes (one file: at most
    # max_media_bytes).
    file_ttl_s: float = 3600.0
    max_file_storage_bytes: int = 2**30

    @property
    def model_name(self) -> str:
        return served_name(self.model, self.served_model_name)

    @property
    def model_names(self) -> list[str]:
        return served_names(self.model, self.served_model_name)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


# flag → (GatewayConfig field, type, help). `model` is the only required one.
_FLAGS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--model": ("model", str, "checkpoint folder or Hugging Face Hub id (tokenizer, chat template)"),
    "--served-model-name": ("served_model_name", str, "names clients use, the first one reported "
                                                      "(default: the folder's name, or the Hub id)"),
    "--chat-template": ("chat_template", str, "Jinja chat template file (or the template itself) "
                                              "used instead of the model's"),
    "--generation-config": ("generation_config", str, "sampling defaults for parameters a request "
                                                      "leaves out: 'auto' (the model's "
                                                      "generation_config.json), 'vllm' (none), or a folder"),
    "--redis-url": ("redis_url", str, "Redis the services meet in"),
    "--key-prefix": ("key_prefix", str, "prefix of every Redis key"),
    "--host": ("host", str, "HTTP bind address"),
    "--port": ("port", int, "HTTP port"),
    "--max-body-bytes": ("max_body_bytes", int, "largest accepted request body"),
    "--default-max-tokens": ("default_max_tokens", int, "max_tokens of /v1/completions when absent"),
    "--request-timeout-s": ("request_timeout_s", float, "longest wait for the next token event"),
    "--worker-cache-ttl-s": ("worker_cache_ttl_s", float, "seconds the live-worker list is cached"),
    "--max-unread-events": ("max_unread_events", positive_int, "token events per sequence a stream may leave unread "
                            "(its client not reading) before its request is aborted"),
    "--drain-timeout": ("drain_timeout_s", float, "on SIGTERM, seconds to let open requests and "
                                                  "streams finish (no new connections) before closing them"),
    "--timeout-keep-alive": ("timeout_keep_alive_s", float, "seconds an idle keep-alive connection "
                                                            "stays open (longer than clients keep them)"),
    "--tool-call-parser": ("tool_call_parser", str, "how the model writes tool calls: "
                                                    + ", ".join(TOOL_PARSER_NAMES)),
    "--limit-mm-per-prompt": ("limit_mm_per_prompt", limits_arg,
                              'most media items of each kind per prompt, JSON: {"image": 8, "video": 1}'),
    "--media-io-kwargs": ("media_io_kwargs", media_io_kwargs_arg,
                          'video sampling, JSON: {"video": {"num_frames": 32, "fps": 2}} '
                          "(the fewer frames of the two)"),
    "--allowed-local-media-path": ("allowed_local_media_path", str,
                                   "folder local media files (file:// or a path) may be read from; "
                                   "unset: local files are refused"),
    "--media-fetch-timeout-s": ("media_fetch_timeout_s", float, "seconds to fetch one media URL"),
    "--max-media-bytes": ("max_media_bytes", int, "largest image or video file accepted"),
    "--max-image-pixels": ("max_image_pixels", int, "most pixels of an image or video frame"),
    "--max-video-frames": ("max_video_frames", int, "most frames of a video, before sampling"),
    "--media-ttl-s": ("media_ttl_s", float, "seconds stored media live after their last use"),
    "--file-ttl-s": ("file_ttl_s", float, "seconds an uploaded file (/v1/files) lives at most"),
    "--max-file-storage-bytes": ("max_file_storage_bytes", int, "most bytes all uploaded files "
                                                                "(/v1/files) take together"),
}


def add_cli_args(flags: EnvFlags) -> None:
    """Add every gateway flag (each also read from its PAGEDSERVE_* variable: proto/env_flags.py);
    one the command already has (--redis-url, --model, ...) keeps its first definition."""
    defaults = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}
    for flag, (field, kind, help_text) in _FLAGS.items():
        if field == "served_model_name":
            flags.names(flag, help=help_text)
            continue
        default = defaults.get(field)
        flags.add(flag, type=kind, default=None if default is dataclasses.MISSING else default,
                  required=field == "model", help=help_text,
                  choices=TOOL_PARSER_NAMES if field == "tool_call_parser" else None)
    # Flags add to the keys from the environment: any of them is accepted.
    flags.repeated("--api-key", help="require `Authorization: Bearer <key>` on /v1 routes; "
                                     "repeat for several keys")
    flags.switch("--protect-metrics", help="with API keys, /metrics and /health want a key too")
    flags.switch("--enable-auto-tool-choice", help="let the model decide when to call tools "
                                                   "(tool_choice absent or 'auto'; needs --tool-call-parser)")
    flags.names("--allowed-media-domains", help="host names http(s) media may come from "
                                                "(unset: any)")
    flags.add("--allowed-media-networks", type=networks_arg,
              help="comma-separated CIDRs (10.0.0.0/8,fd00::/8) whose internal addresses http(s) "
                   "media may come from (unset: only public addresses are fetched)")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """GatewayConfig from parsed args; fields the namespace lacks keep their defaults."""
    dests = {field: flag.removeprefix("--").replace("-", "_") for flag, (field, _, _) in _FLAGS.items()}
    values = {field: getattr(args, dest) for field, dest in dests.items()
              if getattr(args, dest, None) is not None}
    keys = tuple(getattr(args, "api_key", None) or ())
    values["api_keys"] = tuple(dict.fromkeys(k for k in keys if k))  # no duplicates, order kept
    values["protect_metrics"] = bool(getattr(args, "protect_metrics", False))
    values["enable_auto_tool_choice"] = bool(getattr(args, "enable_auto_tool_choice", False))
    domains = (getattr(args, "allowed_media_domains", None) or "").split(",")
    values["allowed_media_domains"] = tuple(dict.fromkeys(d.strip().lower() for d in domains if d.strip()))
    networks = parse_networks(getattr(args, "allowed_media_networks", None) or "")
    values["allowed_media_networks"] = tuple(str(n) for n in networks)
    return GatewayConfig(**values)
