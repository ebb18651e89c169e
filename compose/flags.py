"""The flags of each `pagedserve` command, every one also read from its `PAGEDSERVE_*`
environment variable (proto/env_flags.py). Plain argparse and stdlib imports only, so
`pagedserve --help` stays instant and the launcher can parse a gateway's flags without
importing any command."""

from __future__ import annotations

import argparse

from gateway.config import add_cli_args as add_gateway_flags  # stdlib-only module
from proto.env_flags import EnvFlags


def parse_bytes(text: str) -> int:
    """'256MiB', '2GiB', '1.5GB', '1048576' → bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lowered = text.strip().lower()
    for unit, scale in units.items():
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(lowered)


def _budget(text: str) -> int | None:
    """--encoder-budget: "auto" (None) or a count >= 0."""
    if text == "auto":
        return None
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 0 or auto")
    return value


def add_common_flags(f: EnvFlags) -> None:
    """What every service needs: where Redis is, and how much to log."""
    f.add("--redis-url", default="redis://127.0.0.1:6379/0", help="Redis the services meet in")
    f.add("--key-prefix", default="pagedserve", help="prefix of every Redis key")
    f.add("--log-level", default="info", help="debug|info|warning")


def add_runner_flags(f: EnvFlags) -> None:
    """The model runner's flags: shared by `worker` and `engine`."""
    f.add("--model", required=True, help="Hugging Face checkpoint folder")
    f.names("--served-model-name", help="names clients use, the first one reported (default: the "
                                       "folder's name, or the Hub id)")
    f.add("--block-size", type=int, default=16, help="tokens per KV block")
    f.add("--kv-cache-memory", type=parse_bytes, default="256MiB", help="memory for the KV cache")
    f.add("--gpu-memory-utilization", type=float,
          help="on a GPU, size the KV cache so the worker fills this share of the device's memory "
               "(e.g. 0.9; overrides --kv-cache-memory)")
    f.add("--num-blocks", type=int, help="KV blocks (overrides --kv-cache-memory and --gpu-memory-utilization)")
    f.add("--swap-space", type=parse_bytes, default="256MiB",
          help="CPU memory for blocks swapped out (--preemption-mode swap on the scheduler)")
    f.add("--max-model-len", type=int, help="default: the model's max_position_embeddings")
    f.add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
          help="weights, activations and KV cache; auto: the checkpoint's dtype where the "
               "device computes it natively (CPU: AVX512-BF16/AMX for bf16), else float32")
    f.add("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
          help="auto: the model's dtype; bfloat16: K/V kept in bf16 for an fp32 model (CPU): twice "
               "the blocks in the same memory and half the bytes a decode's attention reads, "
               "attention still computed in fp32")
    f.add("--quantization", choices=["none", "int8"], default="none",
          help="int8: the linear layers' weights (not the LM head) in int8, per output channel, "
               "quantized at load; matmuls with int8 dot products (VNNI/AMX-INT8) where torch has them")
    f.add("--load-format", default="auto", choices=["auto", "dummy"],
          help="auto: the checkpoint's safetensors files; dummy: random weights of config.json's shapes "
               "and dtype, made on the device, no weight file read (to run or benchmark a model not "
               "downloaded: the folder needs config.json and the tokenizer's files)")
    f.add("--device", default="cpu", help="cpu|cuda|cuda:N")
    f.add("--attention-backend", default="auto", help="auto|torch|cpu|triton")
    f.switch("--enforce-eager", help="on a GPU, run every step eagerly: no CUDA graphs for decode steps")
    f.add("--max-cudagraph-capture-size", type=int, default=256,
          help="on a GPU, the largest decode batch replayed as a CUDA graph (graphs are captured at "
               "start for 1, 2, 4, 8, 16, ... up to it); larger decode batches run eagerly")
    f.add("--threads", type=int, help="CPU compute threads (default: the CPUs the process may use -- affinity "
          "and cgroup quota -- adjusted while serving to what other processes leave: modeling/cpu_threads.py)")
    f.add("--seed", type=int, default=0)
    f.add("--encoder-cache-memory", type=parse_bytes, default="256MiB",
          help="vision models: memory on the device for image embeddings kept by content hash, "
               "so an image or video frame that comes again is not encoded again")


def add_batching_flags(f: EnvFlags) -> None:
    """The batching core's flags: shared by `scheduler` and `engine`."""
    f.add("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    f.add("--max-num-seqs", type=int, default=256, help="requests in one step at most")
    f.switch("--no-prefix-caching", help="compute every prompt in full")
    f.add("--preemption-mode", default="recompute", choices=["recompute", "swap"],
          help="free a preempted request's blocks (recompute) or move them to the worker's CPU swap space")
    f.add("--encoder-budget", type=_budget, default="auto",
          help="vision models: images (or video frames) one step may make its worker encode, those "
               "whose embeddings it holds or the encoder service published aside; a burst of new "
               "images is spread over steps so running decodes keep their pace; 0 = no bound; "
               "auto: 2 for a CPU worker, no bound on a GPU")


def add_worker_flags(f: EnvFlags) -> None:
    add_runner_flags(f)
    f.add("--host", default="127.0.0.1", help="gRPC bind address")
    f.add("--port", type=int, default=50051, help="gRPC port (0 = any free one)")
    f.add("--advertise-host", help="address schedulers dial (default: --host)")
    f.add("--worker-id", help="default: random")
    f.add("--drain-timeout", type=float, default=30.0,
          help="on SIGTERM, seconds to let running requests finish (no new ones come) before "
               "handing the rest to other workers; 0 = hand over at once")
    f.add("--metrics-port", type=int, default=0,
          help="serve Prometheus /metrics (steps) on --host at this port; 0 = off")
    add_common_flags(f)


def add_encoder_flags(f: EnvFlags) -> None:
    f.add("--model", required=True, help="the vision checkpoint the workers serve (folder or Hub id)")
    f.names("--served-model-name", help="as the workers' (default: the folder's name, or the Hub id)")
    f.add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
          help="as the workers' --dtype (resolved the same way): workers use only embeddings "
               "of their own dtype and weights")
    f.add("--load-format", default="auto", choices=["auto", "dummy"],
          help="as the workers' --load-format: dummy makes the same random weights as theirs")
    f.add("--device", default="cpu", help="cpu|cuda|cuda:N")
    f.add("--threads", type=int, help="CPU compute threads (default: the CPUs the process may use -- "
          "affinity and cgroup quota)")
    f.add("--encoder-id", help="default: encoder-<hostname>-<random>")
    f.add("--batch", type=int, default=8, help="media encoded in one call at most")
    f.add("--embeddings-ttl-s", type=float, default=300.0,
          help="seconds published embeddings live in Redis (a question after that encodes on "
               "its worker); each costs mm_tokens x hidden x dtype bytes (Gemma 3 12B bf16: 2 MB)")
    f.add("--claim-ttl-s", type=float, default=10.0,
          help="a medium being encoded is claimed this long at most (longer than one batch "
               "takes); a dead encoder's jobs go to another after it")
    f.add("--host", default="127.0.0.1", help="bind address of /metrics and /health")
    f.add("--metrics-port", type=int, default=0, help="serve /metrics and /health here; 0 = off")
    add_common_flags(f)


def add_scheduler_flags(f: EnvFlags) -> None:
    add_batching_flags(f)
    f.add("--consumer-name", help="stream consumer name (default: scheduler-<hostname>)")
    f.add("--async-scheduling", default="auto", choices=["auto", "on", "off"],
          help="plan each step while the one before runs on the worker (on), or after its "
               "result (off); auto: on for workers on an accelerator, off on the CPU")
    f.add("--shards", type=int, default=1,
          help="scheduler shards: each its own requests stream, lease and share of the workers; "
               "the schedulers lead about shards / schedulers each (give every scheduler the same "
               "number). More shards, more schedulers driving the fleet at once")
    f.add("--max-waiting-requests", type=int, default=1024,
          help="requests waiting for a step at most; beyond it the gateway answers 429 with "
               "Retry-After (0 = no bound)")
    f.add("--step-timeout", type=float, default=120.0,
          help="seconds a worker has for one step before it counts as dead (retired, its requests "
               "rerouted); raise it for a large model on a CPU, whose first image step takes minutes")
    f.add("--metrics-host", default="127.0.0.1", help="bind address of /metrics")
    f.add("--metrics-port", type=int, default=0,
          help="serve Prometheus /metrics (every worker's accounting) at this port; 0 = off")
    f.add("--stats-interval", type=float, default=1.0,
          help="seconds between two writes of each worker's WorkerStats (its Redis key, which the "
               "gateway's /metrics renders, and this /metrics), while it runs steps and while idle")
    add_common_flags(f)


def add_service_gateway_flags(f: EnvFlags) -> None:
    add_common_flags(f)
    add_gateway_flags(f)
    f.switch("--reuse-port", help="bind --port with SO_REUSEPORT, so several gateway processes share it "
                                  "(the kernel spreads connections over them; `pagedserve up --gateways N`)")


def add_engine_flags(f: EnvFlags) -> None:
    add_runner_flags(f)
    add_batching_flags(f)
    add_common_flags(f)
    add_gateway_flags(f)  # skips the flags already there (--model, --served-model-name, ...)


def add_up_flags(f: EnvFlags) -> None:
    f.add("--model", help="checkpoint folder (default: make the `small` preset in ./models/small)")
    f.add("--preset", default="small", help="preset made when --model is not given")
    f.add("--host", default="127.0.0.1")
    f.add("--port", type=int, default=8000)
    f.add("--workers", type=int, default=1)
    f.add("--gateways", type=int, default=1,
          help="gateway processes to run, all on --port (SO_REUSEPORT: the kernel spreads connections "
               "over them); any one's /metrics shows every gateway's metrics summed")
    f.add("--schedulers", type=int, default=1,
          help="schedulers to run: they share the --shards (one shard: one leads, the others "
               "stand by to take over)")
    f.add("--shards", type=int, default=1,
          help="scheduler shards (pagedserve scheduler --shards): each led by one scheduler, "
               "driving its share of the workers")
    f.add("--encoders", type=int, default=0,
          help="vision models: encoder services to run beside the workers (pagedserve encoder): "
               "media encoded as they are stored, ahead of the questions; 0 = the workers encode")
    f.add("--redis-url", help="use this Redis instead of starting one")
    f.add("--run-dir", default=".run", help="logs of every process go here")
    p = f.parser
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag for every worker")
    p.add_argument("--encoder-arg", action="append", default=[], help="extra flag for every encoder")
    p.add_argument("--scheduler-arg", action="append", default=[], help="extra flag for the scheduler")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra flag for every gateway")


def add_bench_flags(f: EnvFlags) -> None:
    f.parser.add_argument("bench_args", nargs="*",
                          help="bench/stack/serve.py's flags (see `pagedserve bench --help`)")


def add_make_model_flags(f: EnvFlags) -> None:
    f.parser.add_argument("dir")
    f.add("--preset", default="tiny", choices=MAKE_MODEL_PRESETS,
          help="tiny/small/1b: random weights of that size; gemma-3-*-it: the release's files, "
               "with --config-only and --arch gemma3-vision")
    f.add("--arch", default="llama")
    f.add("--seed", type=int, default=0)
    f.parser.add_argument("--config-only", action="store_true",
                          help="write everything but the weights (serve it with --load-format dummy)")


# tools/model_presets.py's PRESETS, named here so that --help needs no torch
MAKE_MODEL_PRESETS = ["tiny", "small", "1b", "gemma-3-4b-it", "gemma-3-12b-it", "gemma-3-27b-it"]


def add_compose_gpu_flags(f: EnvFlags) -> None:
    from compose.gpu_override import gpu_ids  # yaml: only this command loads it

    f.parser.add_argument("--gpus", type=gpu_ids, required=True,
                          help="a count (4: GPUs 0-3) or the ids (0,2,3): one worker service each")
    f.parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                          help="each worker fills this share of its GPU's memory (KV cache sized to it)")


def gateway_parser() -> argparse.ArgumentParser:
    """`pagedserve gateway`'s flags alone (the launcher reads the gateway's config with it)."""
    parser = argparse.ArgumentParser(prog="pagedserve gateway")
    add_service_gateway_flags(EnvFlags(parser))
    return parser
