"""Batched sampling and the finish rule."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from proto import worker_pb2
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.sampler import (ARGMAX_CHUNK, SamplingBatch, exponential_race, first_argmax, keyed_exponential,
                                keyed_exponential_one, position_seed, position_seeds, sample)
from worker_svc.stop import finish_reason

Params = worker_pb2.SamplingParams


def batch_of(params, seeds=None, vocab=100):
    return SamplingBatch.build(params, seeds or [None] * len(params), vocab)


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax():
    logits = torch.randn(8, 100, generator=gen(0))
    out = sample(logits, batch_of([Params(temperature=0.0)] * 8), gen(1))
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    logits = torch.randn(4, 100, generator=gen(0))
    for row, ties in enumerate([(3, 40), (0, 99), (57, 58, 59), (12,)]):
        logits[row, list(ties)] = 10.0
    out = sample(logits, batch_of([Params(temperature=0.0)] * 4), gen(1))
    assert out.tolist() == [3, 0, 57, 12]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [100, 2 * ARGMAX_CHUNK, 3 * ARGMAX_CHUNK + 17, 32000])
def test_first_argmax_is_max_dim_indices(dtype, vocab):
    """The chunked argmax against its reference, max(dim).indices, on what tells them apart:
    ties inside a chunk, across chunks and with the tail; NaNs in the body, in the tail and
    in both; a row of -inf; bf16's many equal values."""
    x = torch.randn(12, vocab, generator=gen(5)).to(dtype)
    last = vocab - 1
    x[0, [7, 9]] = 50.0                           # a tie in one chunk
    x[1, [5, last // 2, last]] = 50.0             # ties across chunks and with the tail
    x[2, last] = 50.0                             # the max in the tail alone
    x[3, [last // 3, last]] = float("nan")        # NaNs in the body and the tail
    x[4, last] = float("nan")                     # a NaN in the tail alone
    x[5, vocab // 2] = float("nan")               # a NaN in the body alone
    x[6] = float("-inf")
    x[7] = x[7].round()                           # many ties
    x[8, ARGMAX_CHUNK - 1 if vocab > ARGMAX_CHUNK else 0] = 50.0  # the last of a chunk
    x[9, [min(ARGMAX_CHUNK, last), last]] = 50.0  # the first of a chunk, then the tail
    assert torch.equal(first_argmax(x), x.max(dim=-1).indices)
    assert torch.equal(first_argmax(x[:, : vocab - 1]), x[:, : vocab - 1].max(dim=-1).indices)  # not contiguous


def test_top_k_one_is_greedy_and_greedy_rows_stay_greedy_in_mixed_batches():
    logits = torch.randn(6, 100, generator=gen(2))
    params = [Params(temperature=1.3, top_k=1), Params(temperature=0.0),
              Params(temperature=0.7, top_k=1, top_p=0.9), Params(temperature=0.0, top_k=5),
              Params(temperature=2.0, top_k=1, seed=3), Params(temperature=0.0, top_p=0.2)]
    out = sample(logits, batch_of(params, [None, None, None, None, position_seed(3, 0), None]), gen(4))
    assert torch.equal(out, logits.argmax(-1))


def test_seeded_rows_reproduce_whatever_the_batch():
    """A seeded request draws the same tokens step after step, alone or at another row
    next to unseeded and differently seeded neighbours."""
    vocab = 50
    steps = [torch.randn(1, vocab, generator=gen(10 + i)) for i in range(6)]
    mine = Params(temperature=1.0, top_p=0.95, seed=1234)

    def run(neighbours_before, neighbours_after, shared_seed):
        shared = gen(shared_seed)
        tokens = []
        for i, row in enumerate(steps):
            before = torch.randn(neighbours_before, vocab, generator=gen(100 + i))
            after = torch.randn(neighbours_after, vocab, generator=gen(200 + i))
            params = ([Params(temperature=0.8)] * neighbours_before + [mine]
                      + [Params(temperature=1.0, seed=77, top_k=10)] * neighbours_after)
            seeds = [None] * neighbours_before + [position_seed(1234, i)] + [position_seed(77, i)] * neighbours_after
            out = sample(torch.cat([before, row, after]), batch_of(params, seeds, vocab), shared)
            tokens.append(int(out[neighbours_before]))
        return tokens

    alone = run(0, 0, 5)
    assert run(3, 2, 6) == alone
    assert run(7, 0, 7) == alone
    assert len(set(alone)) > 1  # it really samples


def test_top_k_and_top_p_only_pick_allowed_tokens():
    probs = torch.tensor([0.05, 0.5, 0.02, 0.3, 0.1, 0.03])
    logits = probs.log().expand(4000, -1).contiguous()
    cases = [
        (Params(temperature=1.0, top_k=2), {1, 3}),
        (Params(temperature=1.0, top_p=0.75), {1, 3}),
        (Params(temperature=1.0, top_p=0.85), {1, 3, 4}),
        (Params(temperature=1.0, top_k=3, top_p=0.99), {1, 3, 4}),
        (Params(temperature=1.0, top_p=0.01), {1}),
    ]
    for params, allowed in cases:
        out = sample(logits, batch_of([params] * len(logits), vocab=6), gen(9))
        assert set(out.tolist()) == allowed, params


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    temperature = 0.5
    logits = (probs.log() * temperature).expand(20000, -1).contiguous()  # / T gives back probs
    out = sample(logits, batch_of([Params(temperature=temperature)] * 20000, vocab=3), gen(11))
    freq = torch.bincount(out, minlength=3).float() / len(out)
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


def test_seeded_request_in_runner_ignores_its_neighbours(tiny_model_dir):
    """End to end: a seeded request's tokens do not depend on what else runs."""

    def run(with_neighbours: bool) -> list[int]:
        runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64))
        sp = Params(max_tokens=8, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
        new = [worker_pb2.NewRequestData(request_id="s", token_ids=[5, 9, 11, 13, 40],
                                         num_prompt_tokens=5, block_ids=[3, 7, 8], sampling=sp)]
        if with_neighbours:
            other = Params(max_tokens=8, temperature=1.0, ignore_eos=True)
            new.append(worker_pb2.NewRequestData(request_id="o", token_ids=[7] * 9, num_prompt_tokens=9,
                                                 block_ids=[10, 11, 12, 13], sampling=other))
        sched = {r.request_id: len(r.token_ids) for r in new}
        tokens = []
        for step in range(8):
            out = runner.step(worker_pb2.StepRequest(step_id=step, new_requests=new,
                                                     num_scheduled_tokens=sched))
            new = []
            tokens += [s.token_id for s in out.result.sampled if s.request_id == "s"]
            sched = {s.request_id: 1 for s in out.result.sampled if not s.finish_reason}
        return tokens

    assert run(True) == run(False)


@pytest.mark.parametrize("kwargs,n_out,token,n_total,expected", [
    (dict(max_tokens=10), 3, 0, 20, "stop"),  # EOS
    (dict(max_tokens=10), 3, 2, 20, "stop"),  # the other EOS id
    (dict(max_tokens=10, ignore_eos=True), 3, 0, 20, None),
    (dict(max_tokens=10, stop_token_ids=[7]), 3, 7, 20, "stop"),
    (dict(max_tokens=10, stop_token_ids=[7], ignore_eos=True), 3, 7, 20, "stop"),
    (dict(max_tokens=10, min_tokens=4), 3, 0, 20, None),  # EOS before min_tokens
    (dict(max_tokens=10, min_tokens=4, stop_token_ids=[7]), 3, 7, 20, None),
    (dict(max_tokens=10, min_tokens=4), 4, 0, 20, "stop"),
    (dict(max_tokens=10), 9, 5, 20, None),
    (dict(max_tokens=10), 10, 5, 20, "length"),
    (dict(max_tokens=10), 10, 0, 20, "stop"),  # stop wins over length
    (dict(max_tokens=10, min_tokens=20), 10, 0, 20, "length"),
    (dict(max_tokens=100), 5, 5, 64, "length"),  # reached max_model_len
    (dict(max_tokens=100), 5, 5, 63, None),
    (dict(max_tokens=0), 500, 5, 63, None),  # unset max_tokens: only max_model_len caps
])
def test_finish_rule(kwargs, n_out, token, n_total, expected):
    assert finish_reason(Params(**kwargs), n_out, token, (0, 2), n_total, 64) == expected


def test_keyed_exponential_matches_its_reference_and_is_exp1():
    """Each entry is the plain-Python splitmix64 reference's; over many entries the noise
    has Exp(1)'s mean, variance and tail, and rows of neighbouring seeds are unrelated."""
    seeds = [0, 1, 2, 2**63 - 1, position_seed(1234, 7), position_seed(2**64 - 1, 0)]
    noise = keyed_exponential(torch.tensor([s - 2**64 if s >= 2**63 else s for s in seeds]), 300)
    want = torch.tensor([[keyed_exponential_one(s, v) for v in range(300)] for s in seeds])
    torch.testing.assert_close(noise, want)
    big = keyed_exponential(torch.arange(64, dtype=torch.int64), 50_000).double()
    assert bool((big > 0).all()) and bool(big.isfinite().all())
    assert abs(big.mean().item() - 1) < 0.005 and abs(big.var().item() - 1) < 0.02
    assert abs((big > 3).double().mean().item() - math.exp(-3)) < 0.002
    assert abs(torch.corrcoef(big[:2])[0, 1].item()) < 0.01  # seeds 0 and 1


def test_position_seeds_are_the_references_elementwise():
    pairs = [(0, 0), (1, 0), (0, 1), (-1, 5), (2**63 - 1, 2**31), (-2**63, 7), (1234, 10**9), (-77, 3)]
    got = position_seeds(np.array([s for s, _ in pairs], dtype=np.int64), np.array([p for _, p in pairs]))
    assert got.dtype == np.int64
    assert [int(v) & (2**64 - 1) for v in got] == [position_seed(s, p) for s, p in pairs]


def test_a_batch_without_greedy_rows_samples_without_the_argmax():
    logits = torch.randn(6, 300, generator=gen(8))
    batch = batch_of([Params(temperature=0.7)] * 6, [position_seed(9, i) for i in range(6)], vocab=300)
    assert not batch.any_greedy
    with_where = dataclasses.replace(batch, any_greedy=True)
    assert torch.equal(sample(logits, batch, gen(1)), sample(logits, with_where, gen(1)))
    assert batch_of([Params(temperature=0.7), Params(temperature=0.0)], vocab=300).any_greedy


def test_the_race_in_blocks_of_rows_draws_what_it_draws_at_once():
    probs = torch.randn(37, 300, generator=gen(3)).softmax(-1)
    seeds = torch.randint(-2**63, 2**63 - 1, (37,), generator=gen(4))
    whole = exponential_race(probs, seeds)
    assert torch.equal(whole, first_argmax(probs / keyed_exponential(seeds, 300)))
    for max_elements in (1, 300, 301, 3000, 300 * 36):  # 1 row a block, ..., 36 then 1
        assert torch.equal(exponential_race(probs, seeds, max_elements), whole), max_elements
