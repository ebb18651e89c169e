"""Configuration of the worker's compute core (ModelRunner). Service settings (address,
Redis, heartbeats) live in the server's own dataclass."""

from dataclasses import dataclass

from proto.model_source import served_name


@dataclass(frozen=True)
class RunnerConfig:
    model: str  # checkpoint folder (config.json, *.safetensors, tokenizer files) or Hub id
    served_model_name: str | None = None  # default: the folder's basename, or the Hub id
    block_size: int = 16
    kv_cache_memory_bytes: int = 256 * 2**20  # K + V of every layer
    gpu_memory_utilization: float | None = None  # instead: this share of the GPU (kv_budget.py)
    num_blocks: int | None = None  # overrides the memory sizing (tests force preemption)
    swap_space_bytes: int = 256 * 2**20  # CPU memory for swapped-out blocks (K + V)
    num_cpu_blocks: int | None = None  # overrides the swap space sizing
    max_model_len: int | None = None  # default: config max_position_embeddings
    # "auto" = the checkpoint's where native (loader.resolve_dtype); or float32 / bfloat16 / float16
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # "auto" = dtype; "bfloat16": bf16 K/V (CPU; kvstore/cache_tensors.py)
    quantization: str | None = None  # "int8": int8 weights, quantized at load (modeling/int8_linear.py)
    # "dummy": random weights of config.json's shapes, no file read (modeling/dummy_weights.py)
    load_format: str = "auto"
    device: str = "cpu"
    # CPU compute threads; None: from the CPUs the process may use, adjusted while serving
    # to what other processes leave (modeling/cpu_threads.py)
    threads: int | None = None
    attention_backend: str = "auto"
    # CUDA graphs for pure-decode steps (worker_svc/cuda_graphs.py): off with enforce_eager;
    # captured for decode batches up to this many requests (larger ones run eagerly)
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = 256
    seed: int = 0  # seeds the generator of requests that carry no seed of their own
    # image embeddings kept by content hash (vision/encoder_cache.py), on the device;
    # vision checkpoints only
    encoder_cache_memory_bytes: int = 256 * 2**20

    @property
    def model_name(self) -> str:
        return served_name(self.model, self.served_model_name)
