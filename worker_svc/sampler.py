"""Batched sampling for one step: one token per logits row.

    greedy rows (temperature ~ 0): argmax of the raw logits
    other rows: logits / temperature → top-k mask → top-p mask → softmax → draw

Masks work on one ascending sort of the batch (no per-request Python over the vocabulary).
The draw uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from
p. Rows of seeded requests fill their E from their own torch.Generator (made once per
request, kept in its state), so a seeded request draws the same tokens whatever else is in
the batch; the other rows share the runner's generator.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-5  # temperatures below this are greedy


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors, normalised so "off" is uniform:
    temperature 0 → greedy, top_k 0 → off, top_p outside (0, 1) → off."""

    temperatures: torch.Tensor  # float32 [S]; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # bool [S]
    top_ks: torch.Tensor | None  # int64 [S], vocab size where off; None: no row uses it
    top_ps: torch.Tensor | None  # float32 [S], 1.0 where off; None: no row uses it
    generators: tuple[torch.Generator | None, ...]  # per row; None = the shared generator
    all_greedy: bool

    @classmethod
    def build(cls, params: Sequence, generators: Sequence[torch.Generator | None],
              vocab_size: int, device: str | torch.device = "cpu") -> "SamplingBatch":
        """`params`: objects with temperature, top_k, top_p (proto or msgspec SamplingParams)."""
        greedy = [p.temperature < GREEDY_EPS for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        ps = [p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        use_k = any(ks[i] < vocab_size for i in sampled_rows)
        use_p = any(ps[i] < 1.0 for i in sampled_rows)
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_ks=torch.tensor(ks, dtype=torch.long, device=device) if use_k else None,
            top_ps=torch.tensor(ps, dtype=torch.float32, device=device) if use_p else None,
            generators=tuple(generators),
            all_greedy=all(greedy),
        )


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                      top_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k and outside its top-p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p). Ties at the k-th
    value are all kept."""
    if top_ks is None and top_ps is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the tail comes first
    vocab = logits.shape[-1]
    if top_ks is not None:
        kth = sorted_logits.gather(-1, (vocab - top_ks).clamp(min=0)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        tail = cumulative <= (1.0 - top_ps)[:, None]
        tail[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(tail, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, batch: SamplingBatch,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of `logits` [S, V] (int64 [S]). `generator` serves rows
    without their own generator."""
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy_ids
    scaled = apply_top_k_top_p(logits / batch.temperatures[:, None], batch.top_ks, batch.top_ps)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    noise.exponential_(generator=generator)
    for row, row_generator in enumerate(batch.generators):
        if row_generator is not None:
            noise[row].exponential_(generator=row_generator)
    # exponential_ can return 0: keep p / E finite (a zero-probability token stays at 0)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(batch.greedy, greedy_ids, sampled)
