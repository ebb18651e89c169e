"""`pagedserve` — one command for every service.

    pagedserve up          [--model DIR] [--port 8000] [--workers N]   the whole stack, local processes
    pagedserve gateway     --model DIR ...                            one service alone
    pagedserve scheduler   ...
    pagedserve worker      --model DIR ...
    pagedserve make-model  DIR --preset tiny|small|1b
    pagedserve bench       --base-url URL ...                        the serving benchmark

Every flag `--some-flag` also reads `PAGEDSERVE_SOME_FLAG` from the environment (the flag wins).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _env(flag: str, default=None):
    return os.environ.get("PAGEDSERVE_" + flag.lstrip("-").replace("-", "_").upper(), default)


def _add(parser: argparse.ArgumentParser, flag: str, type=str, default=None, help: str = "", **kw):
    value = _env(flag, default)
    parser.add_argument(flag, type=type, default=type(value) if value is not None else None,
                        help=f"{help} (env PAGEDSERVE_{flag.lstrip('-').replace('-', '_').upper()})", **kw)


def parse_bytes(text: str) -> int:
    """'256MiB', '2GiB', '1.5GB', '1048576' → bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(lowered)


def _add_common(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--redis-url", default="redis://127.0.0.1:6379/0", help="Redis the services meet in")
    _add(parser, "--key-prefix", default="pagedserve", help="prefix of every Redis key")
    _add(parser, "--log-level", default="info", help="debug|info|warning")


def _add_runner_flags(p: argparse.ArgumentParser) -> None:
    """The model runner's flags: shared by `worker` and `engine`."""
    _add(p, "--model", required=_env("--model") is None, help="Hugging Face checkpoint folder")
    _add(p, "--served-model-name", help="name clients use (default: the folder's name)")
    _add(p, "--block-size", type=int, default=16, help="tokens per KV block")
    _add(p, "--kv-cache-memory", type=parse_bytes, default="256MiB", help="memory for the KV cache")
    _add(p, "--num-blocks", type=int, help="KV blocks (overrides --kv-cache-memory)")
    _add(p, "--swap-space", type=parse_bytes, default="256MiB",
         help="CPU memory for blocks swapped out (--preemption-mode swap on the scheduler)")
    _add(p, "--max-model-len", type=int, help="default: the model's max_position_embeddings")
    _add(p, "--dtype", default="auto", help="auto|float32|bfloat16|float16")
    _add(p, "--device", default="cpu", help="cpu|cuda|cuda:N")
    _add(p, "--attention-backend", default="auto", help="auto|torch|cpu|triton")
    _add(p, "--threads", type=int, help="torch CPU threads (default: torch's choice)")
    _add(p, "--seed", type=int, default=0)


def _add_batching_flags(p: argparse.ArgumentParser) -> None:
    """The batching core's flags: shared by `scheduler` and `engine`."""
    _add(p, "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    _add(p, "--max-num-seqs", type=int, default=256, help="requests in one step at most")
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("--no-prefix-caching", "").lower() in ("1", "true", "yes"),
                   help="compute every prompt in full (env PAGEDSERVE_NO_PREFIX_CACHING=1)")
    _add(p, "--preemption-mode", default="recompute", choices=["recompute", "swap"],
         help="free a preempted request's blocks (recompute) or move them to the worker's CPU swap space")
    _add(p, "--num-scheduler-steps", type=int, default=1,
         help="multi-step decoding: a step planned while no request waits runs up to this many "
              "forward passes, one scheduler round trip for all of them; a request arriving "
              "ends it after the current pass. 1 = off. Steps planned ahead (--async-scheduling) "
              "have one pass")


def _worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="a model worker (gRPC server; registers itself in Redis)")
    _add_runner_flags(p)
    _add(p, "--host", default="127.0.0.1", help="gRPC bind address")
    _add(p, "--port", type=int, default=50051, help="gRPC port (0 = any free one)")
    _add(p, "--advertise-host", help="address schedulers dial (default: --host)")
    _add(p, "--worker-id", help="default: random")
    _add(p, "--metrics-port", type=int, default=0,
         help="serve Prometheus /metrics (steps) on --host at this port; 0 = off")
    _add_common(p)


def _scheduler_parser(sub) -> None:
    p = sub.add_parser("scheduler", help="the scheduler (continuous batching, block tables)")
    _add_batching_flags(p)
    _add(p, "--consumer-name", help="stream consumer name (default: scheduler-<hostname>)")
    _add(p, "--async-scheduling", default="auto", choices=["auto", "on", "off"],
         help="plan each step while the one before runs on the worker (on), or after its "
              "result (off); auto: on for workers on an accelerator, off on the CPU")
    _add(p, "--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    _add(p, "--metrics-port", type=int, default=0,
         help="serve Prometheus /metrics (every worker's accounting) at this port; 0 = off")
    _add_common(p)


def _gateway_parser(sub) -> None:
    from gateway.config import add_cli_args  # the gateway's own flags (stdlib-only import)

    p = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway")
    _add_common(p)
    add_cli_args(p)


def _engine_parser(sub) -> None:
    from gateway.config import add_cli_args

    p = sub.add_parser("engine", help="gateway + scheduler core + model in ONE process (no Redis, "
                                      "no gRPC): the yardstick for what the service split costs")
    _add_runner_flags(p)
    _add_batching_flags(p)
    _add_common(p)
    add_cli_args(p)  # skips the flags already there (--model, --served-model-name, ...)


def _up_parser(sub) -> None:
    p = sub.add_parser("up", help="Redis + workers + scheduler + gateway as local processes")
    _add(p, "--model", help="checkpoint folder (default: make the `small` preset in ./models/small)")
    _add(p, "--preset", default="small", help="preset made when --model is not given")
    _add(p, "--host", default="127.0.0.1")
    _add(p, "--port", type=int, default=8000)
    _add(p, "--workers", type=int, default=1)
    _add(p, "--redis-url", help="use this Redis instead of starting one")
    _add(p, "--run-dir", default=".run", help="logs of every process go here")
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra flag for the scheduler")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag for the gateway")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="the serving benchmark (bench/serve.py) against any OpenAI URL",
                       add_help=False)  # its own --help lists its flags
    p.add_argument("bench_args", nargs="*", help="bench/serve.py's flags (see `pagedserve bench --help`)")


def _make_model_parser(sub) -> None:
    p = sub.add_parser("make-model", help="write a random-weight HF checkpoint with a local tokenizer")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "1b"])
    p.add_argument("--arch", default="llama")
    p.add_argument("--seed", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_up_parser, _gateway_parser, _scheduler_parser, _worker_parser, _engine_parser,
                _bench_parser, _make_model_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag after it is bench/serve.py's, --help included
        from compose.commands import run_bench

        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from compose import commands  # imported late: `pagedserve --help` stays instant

    return getattr(commands, "run_" + args.command.replace("-", "_"))(args) or 0


if __name__ == "__main__":
    sys.exit(main())
