"""Logprobs of chosen tokens and their top alternatives, from the model's raw logits.

"Raw" means the distribution the model itself gives (log_softmax of its logits), before
logit_bias, penalties, temperature, grammar masks or top-k/top-p/min-p truncation: the same
numbers whatever sampling settings a request carries (vLLM's default, `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.messages import Logprobs

_ROWS_PER_SLICE = 256  # bounds the float32 [rows, vocab] copy a long prompt would need


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                    num_top: Sequence[int]) -> list[Logprobs]:
    """Row i: the logprob of token_ids[i] under log_softmax(logits[i]), and the num_top[i]
    most likely tokens with theirs (most likely first)."""
    out: list[Logprobs] = []
    for start in range(0, logits.shape[0], _ROWS_PER_SLICE):
        stop = start + _ROWS_PER_SLICE
        out.extend(_gather(logits[start:stop], token_ids[start:stop], num_top[start:stop]))
    return out


def _gather(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[Logprobs]:
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None].long()).squeeze(1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[-1])
    if k <= 0:
        return [Logprobs(c) for c in chosen]
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [Logprobs(c, i[:n], v[:n]) for c, i, v, n in zip(chosen, ids, values, num_top)]


def prompt_logprob_rows(scheduled):
    """Flat-batch rows whose logits give prompt logprobs, for `scheduled` (request state,
    tokens computed now) in batch order: the row of prompt position p predicts prompt token
    p + 1. Returns (rows, target token ids, top-k per row, [(request, first prompt position,
    count)]); call before num_computed_tokens moves."""
    rows: list[int] = []
    targets: list[int] = []
    ks: list[int] = []
    parts = []
    row = 0
    for state, n in scheduled:
        start = state.num_computed_tokens
        stop = min(start + n, state.num_prompt_tokens - 1)
        if state.prompt_logprobs is not None and stop > start:
            rows.extend(range(row, row + stop - start))
            targets.extend(state.token_ids[start + 1:stop + 1])
            ks.extend([state.prompt_logprobs] * (stop - start))
            parts.append((state, start + 1, stop - start))
        row += n
    return rows, targets, ks, parts
