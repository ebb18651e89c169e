"""`pagedserve` — one command for every service.

    pagedserve up          [--model DIR] [--port 8000] [--workers N]   the whole stack, local processes
    pagedserve gateway     --model DIR ...                            one service alone
    pagedserve scheduler   ...
    pagedserve worker      --model DIR ...
    pagedserve encoder     --model DIR ...                            vision: encode media ahead of questions
    pagedserve make-model  DIR --preset tiny|small|1b|gemma-3-12b-it... [--config-only]
    pagedserve compose-gpu --gpus N|0,1,...                           compose override: a GPU per worker
    pagedserve bench       [cameras] --base-url URL ...              the serving benchmark (or bench/cameras/cameras.py)

Every flag `--some-flag` also reads `PAGEDSERVE_SOME_FLAG` from the environment (the flag wins).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from compose import commands, flags
from proto.env_flags import EnvFlags


@dataclass(frozen=True)
class Command:
    help: str
    add_flags: Callable[[EnvFlags], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: dict[str, Command] = {
    "up": Command("Redis + workers + scheduler + gateway as local processes",
                  flags.add_up_flags, commands.run_up),
    "gateway": Command("the OpenAI-compatible HTTP gateway",
                       flags.add_service_gateway_flags, commands.run_gateway),
    "scheduler": Command("the scheduler (continuous batching, block tables)",
                         flags.add_scheduler_flags, commands.run_scheduler),
    "worker": Command("a model worker (gRPC server; registers itself in Redis)",
                      flags.add_worker_flags, commands.run_worker),
    "encoder": Command("a vision encoder: encodes media as gateways store them, publishes the "
                       "embeddings for every worker (optional; scale it on its own)",
                       flags.add_encoder_flags, commands.run_encoder),
    "engine": Command("gateway + scheduler core + model in ONE process (no Redis, no gRPC): "
                      "the yardstick for what the service split costs",
                      flags.add_engine_flags, commands.run_engine),
    "bench": Command("the serving benchmark (bench/stack/serve.py) against any OpenAI URL; "
                     "`bench cameras ...`: the camera-stream benchmark (bench/cameras/cameras.py)",
                     flags.add_bench_flags, commands.run_bench),
    "make-model": Command("write a random-weight HF checkpoint with a local tokenizer",
                          flags.add_make_model_flags, commands.run_make_model),
    "compose-gpu": Command("print a compose override file with one worker service per GPU",
                           flags.add_compose_gpu_flags, commands.run_compose_gpu),
}


MODEL_COMMANDS = ("worker", "engine", "encoder")  # the processes that run a model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        # bench/stack/serve.py has its own --help, listing its flags
        command.add_flags(EnvFlags(sub.add_parser(name, help=command.help, add_help=name != "bench")))
    return parser


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # this process's own command line (not a call from Python)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag after it is bench/stack/serve.py's, --help included
        args = argparse.Namespace(command="bench", bench_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
        if entry and args.command in MODEL_COMMANDS:
            from worker_svc.host_memory import run_with_malloc_tunables

            run_with_malloc_tunables(args.device)  # a step's large tensors without page faults
        logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return COMMANDS[args.command].run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
