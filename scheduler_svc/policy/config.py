"""Configuration of the scheduler's batching core (the service adds its own fields)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits for one worker's steps.

    Chunked prefill is always on: a prompt longer than the budget is computed over several
    steps, so max_num_batched_tokens may be smaller than max_model_len.
    """

    max_num_batched_tokens: int = 2048  # tokens computed per step, all requests together
    max_num_seqs: int = 256  # requests running at once on one worker
    # 0 = off; else one request computes at most this many tokens per step, so a long
    # prompt cannot take the whole budget and stall the decodes batched beside it.
    long_prefill_token_threshold: int = 0
    # Reuse the K/V of full blocks whose token prefix was computed before (kvstore).
    enable_prefix_caching: bool = True
    # How a running request gives up its blocks when the pool runs out: "recompute" frees
    # them (it is recomputed from its tokens later); "swap" has the worker copy them into
    # its CPU swap space (WorkerInfo.num_cpu_blocks) and back when it resumes, falling back
    # to recompute when the swap space is full.
    preemption_mode: str = "recompute"
    # Vision models: images (or video frames) one step may make its worker encode, those
    # the worker holds embeddings of aside (scheduler_svc/policy/encoder_budget.py); 0 = no bound;
    # None = auto, resolved per worker by BatchScheduler.for_worker (2 on the CPU, no bound
    # on an accelerator; a scheduler built without a worker: no bound).
    encoder_budget: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.encoder_budget is not None and self.encoder_budget < 0:
            raise ValueError(f"encoder_budget must be >= 0, got {self.encoder_budget}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
