"""Benchmark workloads, made locally and deterministically (no dataset is downloaded).

Each request is (prompt token ids, max output tokens). Kinds:
  random         input/output lengths uniform in mean·(1 ± spread)
  shared-prefix  one system prompt shared by every request (--shared-fraction of the input),
                 then a unique tail — what prefix caching is for
  long-prompt    long inputs (mean 1536 by default), short outputs
  sharegpt       lengths shaped like ShareGPT conversations: log-normal inputs (median ~190
                 tokens) and outputs (median ~150), clipped to the context
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

KINDS = ("random", "shared-prefix", "long-prompt", "sharegpt")


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "random"
    num_requests: int = 96
    input_mean: int = 256
    output_mean: int = 128
    spread: float = 0.5
    shared_fraction: float = 0.9
    token_low: int = 300  # prompt ids are drawn from [token_low, token_high): ordinary tokens
    token_high: int = 30000
    max_model_len: int = 2048
    seed: int = 0


def make_workload(spec: WorkloadSpec, tokenizer_dir: str | None = None) -> list[tuple[list[int], int]]:
    """The requests of `spec`. With a tokenizer, ids are drawn below its vocabulary's size
    too (decode drops ids it does not know), and every prompt is replaced by the ids its text
    encodes to (encode(decode(ids))), so a server that takes only text sees the same tokens."""
    if tokenizer_dir is None:
        return _draw(spec)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    workload = _draw(replace(spec, token_high=min(spec.token_high, len(tokenizer))))
    return [(tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False), n) for ids, n in workload]


def _draw(spec: WorkloadSpec) -> list[tuple[list[int], int]]:
    rng = random.Random(spec.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(spec.token_low, spec.token_high) for _ in range(n)]

    def around(mean: float) -> int:
        return max(1, int(rng.uniform(mean * (1 - spec.spread), mean * (1 + spec.spread))))

    def fit(n_in: int, n_out: int) -> tuple[int, int]:
        n_in = max(1, min(n_in, spec.max_model_len - 2))
        return n_in, max(1, min(n_out, spec.max_model_len - n_in))

    out = []
    if spec.kind == "random":
        for _ in range(spec.num_requests):
            n_in, n_out = fit(around(spec.input_mean), around(spec.output_mean))
            out.append((tokens(n_in), n_out))
    elif spec.kind == "shared-prefix":
        shared = tokens(min(int(spec.input_mean * spec.shared_fraction), spec.max_model_len - 3))
        for _ in range(spec.num_requests):
            n_in, n_out = fit(len(shared) + max(1, spec.input_mean - len(shared)), around(spec.output_mean))
            out.append((shared + tokens(n_in - len(shared)), n_out))
    elif spec.kind == "long-prompt":
        for _ in range(spec.num_requests):
            n_in, n_out = fit(around(max(spec.input_mean, 1536)), around(min(spec.output_mean, 64)))
            out.append((tokens(n_in), n_out))
    elif spec.kind == "sharegpt":
        for _ in range(spec.num_requests):
            n_in = int(rng.lognormvariate(math.log(190), 0.9))
            n_out = int(rng.lognormvariate(math.log(150), 0.8))
            n_in, n_out = fit(max(4, n_in), max(4, min(n_out, 1024)))
            out.append((tokens(n_in), n_out))
    else:
        raise ValueError(f"unknown workload kind {spec.kind!r}; one of {', '.join(KINDS)}")
    return out
