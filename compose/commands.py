"""What each `pagedserve` subcommand does: build the service's frozen config, run it.

Each service's modules are imported inside its command, so a command loads only what it
runs (a gateway or scheduler never imports torch) and `pagedserve --help` stays instant.
"""

from __future__ import annotations

import argparse
import asyncio
import runpy
import signal
import socket
import sys
from pathlib import Path

from gateway.config import GatewayConfig, config_from_args


def _runner_config(args: argparse.Namespace):
    from worker_svc.config import RunnerConfig

    return RunnerConfig(
        model=args.model, served_model_name=args.served_model_name, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization, num_blocks=args.num_blocks,
        swap_space_bytes=args.swap_space, max_model_len=args.max_model_len, dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        load_format=args.load_format, device=args.device, attention_backend=args.attention_backend,
        seed=args.seed, threads=args.threads,
        enforce_eager=args.enforce_eager, max_cudagraph_capture_size=args.max_cudagraph_capture_size,
        encoder_cache_memory_bytes=args.encoder_cache_memory,
    )


def _batching_config(args: argparse.Namespace):
    from scheduler_svc.policy.config import SchedulerConfig

    return SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=args.max_num_seqs,
                           enable_prefix_caching=not args.no_prefix_caching,
                           preemption_mode=args.preemption_mode, encoder_budget=args.encoder_budget)


def run_worker(args: argparse.Namespace) -> int:
    from worker_svc.server import serve
    from worker_svc.service_config import WorkerServiceConfig

    extra = {"worker_id": args.worker_id} if args.worker_id else {}
    serve(WorkerServiceConfig(runner=_runner_config(args), host=args.host, port=args.port,
                              advertise_host=args.advertise_host, redis_url=args.redis_url,
                              key_prefix=args.key_prefix, metrics_port=args.metrics_port,
                              drain_timeout_s=args.drain_timeout, **extra))
    return 0


def run_encoder(args: argparse.Namespace) -> int:
    import threading

    from encoder_svc.config import EncoderServiceConfig
    from encoder_svc.service import EncoderService

    extra = {"encoder_id": args.encoder_id} if args.encoder_id else {}
    service = EncoderService(EncoderServiceConfig(
        model=args.model, served_model_name=args.served_model_name, dtype=args.dtype, device=args.device,
        load_format=args.load_format,
        threads=args.threads, redis_url=args.redis_url, key_prefix=args.key_prefix, batch=args.batch,
        embeddings_ttl_s=args.embeddings_ttl_s, claim_ttl_s=args.claim_ttl_s, host=args.host,
        metrics_port=args.metrics_port, **extra))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service.run(stop)
    return 0


def scheduler_service_config(args: argparse.Namespace):
    """`pagedserve scheduler`'s flags as its SchedulerServiceConfig."""
    from scheduler_svc.service_config import SchedulerServiceConfig

    extra = {"consumer_name": args.consumer_name} if args.consumer_name else {}
    return SchedulerServiceConfig(batching=_batching_config(args), redis_url=args.redis_url,
                                  key_prefix=args.key_prefix, metrics_host=args.metrics_host,
                                  metrics_port=args.metrics_port,
                                  async_scheduling=args.async_scheduling,
                                  max_waiting_requests=args.max_waiting_requests,
                                  stats_interval_s=args.stats_interval, shards=args.shards,
                                  step_timeout_s=args.step_timeout, **extra)


def run_scheduler(args: argparse.Namespace) -> int:
    from scheduler_svc.service import SchedulerService

    config = scheduler_service_config(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await SchedulerService(config).run(stop)

    asyncio.run(main())
    return 0


def _serve_http(app, args: argparse.Namespace, config: GatewayConfig) -> None:
    """The OpenAI API under uvicorn, on uvloop with the httptools parser (the gateway and
    the engine alike), as `uvicorn[standard]` would pick: less CPU per streamed token than
    asyncio's loop and h11 (5-12% of the gateway's on the serving benchmark:
    docs/performance.md, "The gateway's event loop"), CPU the model needs where both share a
    machine. On SIGTERM uvicorn stops listening and lets open requests and streams finish for
    up to the gateway config's `drain_timeout_s`; idle keep-alive connections stay open for
    its `timeout_keep_alive_s`. With `--reuse-port` the socket is bound here with
    SO_REUSEPORT, so that several gateway processes listen on one port and the kernel spreads
    the connections over them (`pagedserve up --gateways N`)."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level.lower(),
        timeout_graceful_shutdown=config.drain_timeout_s, timeout_keep_alive=config.timeout_keep_alive_s,
        loop="uvloop", http="httptools"))
    sockets = None
    if getattr(args, "reuse_port", False):
        try:
            sockets = [_reuse_port_socket(args.host, args.port)]
        except OSError as exc:  # as uvicorn reports a failed bind: a message and exit code 3
            print(f"could not bind {args.host}:{args.port}: {exc}", file=sys.stderr)
            sys.exit(STARTUP_FAILURE)
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has drained and re-raised it
        pass
    if not server.started:  # the lifespan or the bind failed: exit as uvicorn.run does
        sys.exit(STARTUP_FAILURE)


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEADDR and SO_REUSEPORT; uvicorn listens on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def run_engine(args: argparse.Namespace) -> int:
    from compose.engine import EngineConfig
    from compose.inprocess_backend import InProcessBackend
    from gateway.app import create_app

    engine = EngineConfig(runner=_runner_config(args), batching=_batching_config(args))
    config = config_from_args(args)
    app = create_app(config, backend_factory=lambda: InProcessBackend(engine, config.max_unread_events))
    _serve_http(app, args, config)
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.app import create_app

    config = config_from_args(args)
    _serve_http(create_app(config), args, config)
    return 0


def run_make_model(args: argparse.Namespace) -> int:
    from tools.make_model import make_model

    try:
        path = make_model(Path(args.dir), preset=args.preset, seed=args.seed, arch=args.arch,
                          config_only=args.config_only)
    except ValueError as exc:
        print(f"make-model: {exc}", file=sys.stderr)
        return 2
    what = "configuration (no weights)" if args.config_only else "checkpoint"
    print(f"wrote {args.preset} {args.arch} {what} to {path}")
    return 0


def run_compose_gpu(args: argparse.Namespace) -> int:
    from compose.gpu_override import write_override

    write_override(args.gpus, args.gpu_memory_utilization)
    return 0


def run_up(args: argparse.Namespace) -> int:
    from compose.launcher import Stack, StackConfig

    model = args.model
    if model is None:
        model = str(Path("models") / args.preset)
        if not (Path(model) / "config.json").exists():
            from tools.make_model import make_model

            print(f"no --model given: making the `{args.preset}` preset in {model} (once)", flush=True)
            make_model(Path(model), preset=args.preset, seed=0)
    config = StackConfig(model=model, host=args.host, port=args.port, workers=args.workers, gateways=args.gateways,
                         schedulers=args.schedulers, encoders=args.encoders,
                         encoder_args=tuple(args.encoder_arg), redis_url=args.redis_url, run_dir=Path(args.run_dir),
                         worker_args=tuple(args.worker_arg),
                         scheduler_args=(*(("--shards", str(args.shards)) if args.shards > 1 else ()),
                                         *args.scheduler_arg),
                         gateway_args=tuple(args.gateway_arg))
    with Stack(config) as stack:
        print(f"pagedserve: serving {stack.served_model_name} on {stack.base_url} "
              f"({args.workers} worker(s), logs in {args.run_dir}/); Ctrl-C stops everything", flush=True)
        print("metrics: " + ", ".join(f"{name} {url}" for name, url in stack.metrics_urls.items()), flush=True)
        clean = stack.wait()
    return 0 if clean else 1


# `pagedserve bench NAME ARGS`: bench/<script>; else bench/stack/serve.py
BENCH_SCRIPTS = {"cameras": "cameras/cameras.py"}


def run_bench(args: argparse.Namespace) -> int:
    """`pagedserve bench ARGS`: bench/stack/serve.py; `pagedserve bench cameras ARGS`: bench/cameras/cameras.py
    (the camera-stream benchmark). Each has its own --help."""
    bench_args = list(args.bench_args)
    name = BENCH_SCRIPTS.get(bench_args[0]) if bench_args else None
    if name is not None:
        bench_args = bench_args[1:]
    relative = f"bench/{name or 'stack/serve.py'}"
    script = Path(__file__).resolve().parent.parent / relative
    if not script.exists():
        print(f"{relative} ships with the source checkout; run this from a clone", file=sys.stderr)
        return 2
    sys.argv = [str(script), *bench_args]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
