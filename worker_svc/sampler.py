"""Batched sampling for one step: one token per logits row.

    logits → request-specific edits (grammar mask, logit_bias, min_tokens ban, penalties:
             worker_svc/logits_processors.py)
    greedy rows (temperature ~ 0): argmax of the edited logits
    other rows: / temperature → min-p mask → top-k mask → top-p mask → softmax → draw

Masks work on one ascending sort of the batch (no per-request Python over the vocabulary).
The draw uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from
p. E is a function of (row seed, token id) alone (`keyed_exponential`: splitmix64 of the
pair, in a few batched integer ops over the whole [S, V] block: no per-row generator, no
per-row launch). A seeded request's row seed comes from (request seed, output position)
(`position_seed`; a step's rows at once: `position_seeds`, staged by the persistent batch,
worker_svc/input_batch.py), so it draws the same tokens whatever else is in the batch and
wherever it runs: a request recomputed after a preemption, or moved to another worker or
device, draws for each position what it would have drawn without the move. The other
rows' seeds come from the runner's generator.
"""

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy
import torch

from worker_svc.logits_processors import (History, NoHistory, Penalties, SparseEdit,
                                          build_logit_bias, build_min_tokens_ban, build_penalties)

GREEDY_EPS = 1e-5  # temperatures below this are greedy
_MASK64 = (1 << 64) - 1
ARGMAX_CHUNK = 256  # first_argmax's chunk on the CPU (128-1024 within 10% at 32k-152k vocabularies)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw at output `position`: splitmix64 of the pair, so
    neighbouring seeds and positions give unrelated streams (an int in [0, 2**64)). The
    reference of `position_seeds`, which the worker runs."""
    z = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def position_seeds(seeds: numpy.ndarray, positions: numpy.ndarray) -> numpy.ndarray:
    """`position_seed` of each (seed, position) pair (int64 arrays; numpy's uint64 arithmetic
    wraps as the Python reference's masks do), as int64 bit patterns."""
    z = seeds.astype(numpy.int64).view(numpy.uint64) * numpy.uint64(0x9E3779B97F4A7C15)
    z += positions.astype(numpy.uint64) + numpy.uint64(1)
    z = (z ^ (z >> numpy.uint64(30))) * numpy.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> numpy.uint64(27))) * numpy.uint64(0x94D049BB133111EB)
    return (z ^ (z >> numpy.uint64(31))).view(numpy.int64)


@dataclass(frozen=True)
class RowSeeds:
    """The rows of a batch that draw from seeds of their own, on the sampler's device:
    `bits` (int64 [S]) holds each such row's seed (`position_seed`) as an int64 bit
    pattern where `own` (bool, or int 0/1, [S]) is set; the other rows draw theirs from the
    sampler's generator. The worker's come from its persistent batch
    (worker_svc/input_batch.py), views of the step's one copy."""

    bits: torch.Tensor
    own: torch.Tensor

    @classmethod
    def of(cls, seeds: Sequence[int | None], device: str | torch.device = "cpu") -> "RowSeeds | None":
        """From each row's seed or None; None when no row has one."""
        if all(seed is None for seed in seeds):
            return None
        return cls(bits=torch.tensor([0 if s is None else _signed(s) for s in seeds], dtype=torch.int64,
                                     device=device),
                   own=torch.tensor([s is not None for s in seeds], dtype=torch.bool, device=device))


_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment


def _signed(value: int) -> int:
    """A 64-bit pattern as torch's int64 holds it."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def keyed_exponential(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise, float32 [S, V]: entry (r, v) is a function of (seeds[r], v) alone, the
    (v+1)-th output of splitmix64 started at seeds[r] (int64 [S]), its top 23 bits k a
    uniform u = (k + 1/2) / 2**23 in (0, 1) (exact in float32), -log(u) > 0. The reference,
    one entry in plain Python: `keyed_exponential_one`."""
    tokens = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _signed(_GAMMA)
    z = seeds[:, None] + tokens  # int64 arithmetic wraps, as splitmix64's does
    z = (z ^ _shift_right(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _signed(0x94D049BB133111EB)
    z = z ^ _shift_right(z, 31)
    u = _shift_right(z, 41).to(torch.float32).add_(0.5).mul_(2.0 ** -23)
    return u.log_().neg_()


def keyed_exponential_one(seed: int, token: int) -> float:
    """`keyed_exponential`'s entry for (seed, token), in Python integers (the reference)."""
    z = (seed + (token + 1) * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    u = numpy.float32(((z >> 41) + 0.5) * 2.0 ** -23)
    return float(-numpy.log(u))


NOISE_ELEMENTS = 2**23  # noise made at once: its int64 temporaries take 64 MiB each at most


def exponential_race(probs: torch.Tensor, seeds: torch.Tensor, max_elements: int = NOISE_ELEMENTS) -> torch.Tensor:
    """argmax(p / E) per row, E = keyed_exponential(seeds): a sample of each row of `probs`
    [S, V]. The noise is made for a block of rows at a time, so its memory is bounded
    whatever the batch (the same draws either way: an entry depends on its seed and token).
    The contract and reference of the backends' fused races (one pass, the noise never
    stored; for rows that are finite or NaN, as a softmax's): kernels/cpu_sampling.py (C)
    and kernels/triton_sampling.py."""
    vocab = probs.shape[-1]
    rows = max(1, max_elements // vocab)
    if len(probs) <= rows:
        return first_argmax(probs / keyed_exponential(seeds, vocab))  # noise > 0: see there
    return torch.cat([first_argmax(probs[i:i + rows] / keyed_exponential(seeds[i:i + rows], vocab))
                      for i in range(0, len(probs), rows)])


def row_seeds(seeds: RowSeeds | None, rows: int, generator: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """int64 [rows]: each row's draw seed, its own (`seeds`) or one from `generator`.
    Every row draws from the generator either way, so its stream does not depend on
    which rows are seeded."""
    drawn = torch.randint(-(1 << 63), (1 << 63) - 1, (rows,), dtype=torch.int64,
                          generator=generator, device=device)
    if seeds is None:
        return drawn
    return torch.where(seeds.own.bool(), seeds.bits, drawn)


def row_settings(p, vocab_size: int) -> tuple[float, int, float, float]:
    """One request's (temperature, top_k, top_p, min_p), normalised so "off" is uniform:
    temperature below GREEDY_EPS is greedy, top_k the vocabulary size where off (0 or
    >= vocab), top_p 1.0 where off (outside (0, 1)), min_p 0.0 where off (outside (0, 1])."""
    min_p = float(getattr(p, "min_p", 0.0))
    return (float(p.temperature), p.top_k if 0 < p.top_k < vocab_size else vocab_size,
            float(p.top_p) if 0.0 < p.top_p < 1.0 else 1.0, min_p if 0.0 < min_p <= 1.0 else 0.0)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings as tensors, normalised (row_settings). The worker's come
    from its persistent batch (worker_svc/input_batch.py), views of the step's inputs."""

    temperatures: torch.Tensor  # float32 [S]; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # bool [S] (or int 0/1)
    top_ks: torch.Tensor | None  # int [S], vocab size where off; None: no row uses it
    top_ps: torch.Tensor | None  # float32 [S], 1.0 where off; None: no row uses it
    seeds: RowSeeds | None  # the rows with draw seeds of their own (position_seed); None: no row
    all_greedy: bool
    min_ps: torch.Tensor | None = None  # float32 [S], 0 where off; None: no row uses it
    logit_bias: SparseEdit | None = None
    min_tokens_ban: SparseEdit | None = None
    penalties: Penalties | None = None
    # bool [S, V], True where the row's grammar allows the token; None: no grammar row
    allowed: torch.Tensor | None = None
    any_greedy: bool = True  # False: no row is greedy (no argmax of the logits is needed)

    @classmethod
    def build(cls, params: Sequence, seeds: Sequence[int | None],
              vocab_size: int, device: str | torch.device = "cpu", *,
              histories: Sequence[History] | None = None,
              eos_token_ids: Collection[int] = (),
              allowed: torch.Tensor | None = None) -> "SamplingBatch":
        """`params`: proto or msgspec SamplingParams, one per row. `histories` (each row's
        prompt and output ids) feed penalties and min_tokens; without them every row counts
        as having no tokens yet."""
        if histories is None:
            histories = [NoHistory()] * len(params)
        settings = [row_settings(p, vocab_size) for p in params]
        greedy = [t < GREEDY_EPS for t, *_ in settings]
        temps = [1.0 if g else t for (t, *_), g in zip(settings, greedy)]
        ks = [k for _, k, _, _ in settings]
        ps = [p for _, _, p, _ in settings]
        min_ps = [m for *_, m in settings]
        sampled_rows = [i for i, g in enumerate(greedy) if not g]
        use_k = any(ks[i] < vocab_size for i in sampled_rows)
        use_p = any(ps[i] < 1.0 for i in sampled_rows)
        use_min_p = any(min_ps[i] > 0.0 for i in sampled_rows)
        return cls(
            temperatures=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_ks=torch.tensor(ks, dtype=torch.long, device=device) if use_k else None,
            top_ps=torch.tensor(ps, dtype=torch.float32, device=device) if use_p else None,
            seeds=RowSeeds.of(seeds, device),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            min_ps=torch.tensor(min_ps, dtype=torch.float32, device=device) if use_min_p else None,
            logit_bias=build_logit_bias(params, vocab_size, device),
            min_tokens_ban=build_min_tokens_ban(params, histories, eos_token_ids, vocab_size, device),
            penalties=build_penalties(params, histories, vocab_size, device),
            allowed=allowed,
        )

    def with_edits(self, rows: Sequence, vocab_size: int, eos_token_ids: Collection[int],
                   device: torch.device, allowed: torch.Tensor | None = None) -> "SamplingBatch":
        """This batch with the step's edits of `rows` (each row's `sampling` params and its
        tokens so far, e.g. the worker's RequestState): logit biases, min_tokens bans and
        penalties (worker_svc/logits_processors.py), and the grammar mask `allowed`."""
        params = [r.sampling for r in rows]
        return dataclasses.replace(
            self, allowed=allowed, logit_bias=build_logit_bias(params, vocab_size, device),
            min_tokens_ban=build_min_tokens_ban(params, rows, eos_token_ids, vocab_size, device),
            penalties=build_penalties(params, rows, vocab_size, device))

    @property
    def has_edits(self) -> bool:
        return (self.allowed is not None or self.logit_bias is not None or self.min_tokens_ban is not None
                or self.penalties is not None)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The request-specific edits (module docstring), on a float32 copy of `logits`
        (`logits` itself when no row has one). A row that every edit together leaves without
        a finite logit keeps its grammar's mask alone, so its output still matches (a
        grammar that allows only EOS where min_tokens bans it: the grammar wins), else its
        raw logits (only an absurd request, e.g. every token a stop id under min_tokens, or
        a grammar that allows nothing, gets there)."""
        if not self.has_edits:
            return logits
        raw = logits
        logits = logits.to(torch.float32, copy=True)
        if self.allowed is not None:
            logits.masked_fill_(~self.allowed, float("-inf"))
        if self.logit_bias is not None:
            self.logit_bias.apply_(logits)
        if self.min_tokens_ban is not None:
            self.min_tokens_ban.apply_(logits)
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        if self.allowed is not None or self.min_tokens_ban is not None:
            dead = torch.isneginf(logits.amax(dim=-1))
            fallback = raw.float()
            if self.allowed is not None:
                masked = fallback.masked_fill(~self.allowed, float("-inf"))
                fallback = torch.where(torch.isneginf(masked.amax(dim=-1))[:, None], fallback, masked)
            logits = torch.where(dead[:, None], fallback, logits)
        return logits


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
        kth = sorted_logits.gather(-1, (vocab - top_ks.long()).clamp(min=0)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        tail = cumulative <= (1.0 - top_ps)[:, None]
        tail[:, -1] = False  # the most likely token always survives
        sorted_logits.masked_fill_(tail, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p times the row's top one
    (p_i < min_p * p_max  ⇔  logit_i < logit_max + log(min_p))."""
    if min_ps is None:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_ps)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest value in [S, V] (int64 [S]), the first one among ties
    (a NaN counts as the largest), as `x.max(dim=-1).indices` -- argmax's rule, and
    transformers' greedy choice.

    On the CPU, where max(dim) with indices is a scalar loop per row (0.50 ms on [64, 32000]
    fp32 logits, 2.4 ms on [64, 151936]; EPYC VM), in two vectorized passes: the max of every
    chunk of ARGMAX_CHUNK values (amax), then max(dim) inside the first chunk that holds the
    row's max, and over the tail the chunks leave: 0.10 and 0.46 ms. Elsewhere max(dim)."""
    rows, vocab = x.shape
    chunks = vocab // ARGMAX_CHUNK
    if x.device.type != "cpu" or chunks < 2:
        return x.max(dim=-1).indices
    body = x[:, :chunks * ARGMAX_CHUNK].view(rows, chunks, ARGMAX_CHUNK)
    best = body.amax(dim=-1).max(dim=-1)  # the first chunk holding each row's max
    inside = body[torch.arange(rows), best.indices].max(dim=-1).indices
    ids = best.indices * ARGMAX_CHUNK + inside
    if chunks * ARGMAX_CHUNK < vocab:  # the tail wins only if strictly larger (or a NaN the body lacks)
        tail = x[:, chunks * ARGMAX_CHUNK:].max(dim=-1)
        later = (tail.values > best.values) | (tail.values.isnan() & ~best.values.isnan())
        ids = torch.where(later, tail.indices + chunks * ARGMAX_CHUNK, ids)
    return ids


def sample(logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator | None = None,
           race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One token id per row of `logits` [S, V] (int64 [S]), after `batch.process`.
    `generator` draws the seeds of rows without their own (`batch.seeds`); `race` is an
    `exponential_race` (a backend's fused kernel; None: the torch one here)."""
    logits = batch.process(logits)
    if batch.all_greedy:
        return first_argmax(logits)
    scaled = apply_min_p(logits / batch.temperatures[:, None], batch.min_ps)
    scaled = apply_top_k_top_p(scaled, batch.top_ks, batch.top_ps)
    probs = scaled.softmax(dim=-1)
    sampled = (race or exponential_race)(probs, row_seeds(batch.seeds, len(probs), generator, probs.device))
    if not batch.any_greedy:
        return sampled
    return torch.where(batch.greedy.bool(), first_argmax(logits), sampled)
