"""Request-specific edits of the logits before sampling, all batched over the sampling rows.

In the order the sampler applies them (vLLM's order):

    grammar mask        tokens the request's grammar forbids → -inf   (worker_svc/grammar.py)
    logit_bias          logits[row, token] += bias                    (one sparse index_put_)
    min_tokens          EOS / stop ids → -inf while outputs < min_tokens (one sparse index_put_)
    repetition_penalty  tokens in prompt or output: positive logits / r, negative ones * r
    frequency_penalty   logits -= f * count of the token in the output
    presence_penalty    logits -= p * (token appears in the output)

Counts come from one scatter_add_ over the rows' padded output ids ([S, V] per step), the
"seen" mask from one scatter_ over prompt + output ids; both only when some row uses them.
No Python loop touches the vocabulary: per-row Python work is proportional to the row's
bias entries, stop ids, and (for penalties) its token count.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class RowParams(Protocol):
    """What the processors read from a row's SamplingParams (proto or msgspec)."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float]
    min_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool


class History(Protocol):
    """A row's tokens so far: the prompt, then its outputs (worker RequestState fits)."""

    token_ids: Sequence[int]
    num_prompt_tokens: int


@dataclass(frozen=True)
class NoHistory:
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0


@dataclass(frozen=True)
class SparseEdit:
    rows: torch.Tensor  # int64 [N]
    cols: torch.Tensor  # int64 [N]
    values: torch.Tensor | None  # float32 [N] to add; None: set to -inf

    def apply_(self, logits: torch.Tensor) -> None:
        if self.values is None:
            logits.index_put_((self.rows, self.cols), torch.tensor(float("-inf"), device=logits.device))
        else:
            logits.index_put_((self.rows, self.cols), self.values, accumulate=True)


@dataclass(frozen=True)
class Penalties:
    presence: torch.Tensor  # float32 [S], 0 where off
    frequency: torch.Tensor  # float32 [S], 0 where off
    repetition: torch.Tensor | None  # float32 [S], 1 where off; None: no row uses it
    output_counts: torch.Tensor | None  # float32 [S, V]; None: no frequency/presence penalty
    seen: torch.Tensor | None  # bool [S, V]: in prompt or output; with `repetition` only

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.repetition is not None and self.seen is not None:
            rep = self.repetition[:, None]
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(self.seen, penalised, logits)
        if self.output_counts is not None:
            logits = (logits - self.frequency[:, None] * self.output_counts
                      - self.presence[:, None] * (self.output_counts > 0).float())
        return logits


def uses_edits(p: RowParams) -> bool:
    """Does a request with these settings need any of the edits above (a grammar aside)?"""
    return (bool(p.logit_bias) or p.min_tokens > 0 or p.presence_penalty != 0 or p.frequency_penalty != 0
            or _uses_repetition(p))


def _uses_repetition(p: RowParams) -> bool:
    return p.repetition_penalty > 0 and p.repetition_penalty != 1.0


def build_logit_bias(params: Sequence[RowParams], vocab_size: int,
                     device: torch.device | str) -> SparseEdit | None:
    """Token ids outside the model's vocabulary are skipped (the gateway checks them against
    the tokenizer, whose vocabulary may be smaller or larger than the model's logits)."""
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token, bias in p.logit_bias.items():
            if not 0 <= token < vocab_size:
                continue
            rows.append(row)
            cols.append(token)
            values.append(bias)
    if not rows:
        return None
    return SparseEdit(torch.tensor(rows, device=device), torch.tensor(cols, device=device),
                      torch.tensor(values, dtype=torch.float32, device=device))


def build_min_tokens_ban(params: Sequence[RowParams], histories: Sequence[History],
                         eos_token_ids: Collection[int], vocab_size: int,
                         device: torch.device | str) -> SparseEdit | None:
    """Rows with fewer than min_tokens outputs may not sample EOS (unless ignore_eos) or a
    stop id: they would end the request too early."""
    rows, cols = [], []
    for row, (p, history) in enumerate(zip(params, histories)):
        if p.min_tokens <= 0 or len(history.token_ids) - history.num_prompt_tokens >= p.min_tokens:
            continue
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
        banned = {t for t in banned if 0 <= t < vocab_size}
        rows.extend([row] * len(banned))
        cols.extend(sorted(banned))
    if not rows:
        return None
    return SparseEdit(torch.tensor(rows, device=device), torch.tensor(cols, device=device), None)


def build_penalties(params: Sequence[RowParams], histories: Sequence[History], vocab_size: int,
                    device: torch.device | str) -> Penalties | None:
    use_counts = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
    use_rep = any(_uses_repetition(p) for p in params)
    if not (use_counts or use_rep):
        return None
    outputs = [h.token_ids[h.num_prompt_tokens:] for h in histories]
    counts = token_counts(outputs, vocab_size, device) if use_counts or use_rep else None
    seen = None
    if use_rep:
        prompts = [h.token_ids[:h.num_prompt_tokens] if _uses_repetition(p) else ()
                   for p, h in zip(params, histories)]
        seen = token_counts(prompts, vocab_size, device) > 0
        seen |= counts > 0
    return Penalties(
        presence=torch.tensor([float(p.presence_penalty) for p in params], device=device),
        frequency=torch.tensor([float(p.frequency_penalty) for p in params], device=device),
        repetition=torch.tensor([float(p.repetition_penalty) if _uses_repetition(p) else 1.0
                                 for p in params], device=device) if use_rep else None,
        output_counts=counts if use_counts else None,
        seen=seen,
    )


def token_counts(seqs: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | str) -> torch.Tensor:
    """float32 [len(seqs), vocab_size]: how often each token occurs in each sequence. One
    scatter_add_ over the sequences padded with an out-of-vocabulary column."""
    longest = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab_size + 1, dtype=torch.float32, device=device)
    if longest:
        padded = torch.tensor([list(s) + [vocab_size] * (longest - len(s)) for s in seqs],
                              dtype=torch.long, device=device)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]
