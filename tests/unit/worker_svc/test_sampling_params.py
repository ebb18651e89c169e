"""The OpenAI sampling parameters on the worker: logit_bias, min_tokens, penalties, min_p,
logprobs and prompt logprobs; each checked against a plain per-row reference."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from proto import worker_pb2
from worker_svc.config import RunnerConfig
from worker_svc.logits_processors import NoHistory
from worker_svc.logprobs import gather_logprobs
from worker_svc.model_runner import ModelRunner
from worker_svc.sampler import SamplingBatch, sample

Params = worker_pb2.SamplingParams
VOCAB = 40


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def build(params, histories=None, eos=()):
    return SamplingBatch.build(params, [None] * len(params), VOCAB, histories=histories,
                               eos_token_ids=eos)


def history(prompt, output):
    return NoHistory(token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt))


def test_logit_bias_forces_and_bans():
    logits = torch.randn(3, VOCAB, generator=gen(0))
    top = logits.argmax(-1)
    params = [Params(temperature=0, logit_bias={7: 100.0}),
              Params(temperature=0, logit_bias={int(top[1]): -100.0}),
              Params(temperature=1.0, logit_bias={3: 100.0, 4: 100.0})]
    out = sample(logits, build(params), gen(1))
    assert out[0] == 7
    assert out[1] != top[1] and out[1] == logits[1].topk(2).indices[1]
    assert out[2] in (3, 4)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, 0] = 10.0  # EOS is by far the most likely
    logits[:, 5] = 9.0  # then a stop id
    logits[:, 6] = 8.0
    params = [Params(temperature=0, min_tokens=3, stop_token_ids=[5]),
              Params(temperature=0, min_tokens=3, stop_token_ids=[5]),
              Params(temperature=0, min_tokens=3, ignore_eos=True),
              Params(temperature=0, min_tokens=0)]
    histories = [history([1, 2], [9]), history([1, 2], [9, 9, 9]), history([1], []), history([1], [])]
    out = sample(logits, build(params, histories, eos=(0,)), gen(0))
    assert out.tolist() == [6, 0, 0, 0]


def test_a_grammar_that_allows_only_eos_wins_over_min_tokens():
    """When the grammar's mask and the min_tokens ban leave a row nothing, the row keeps the
    grammar's mask (its output must match: EOS here), not its raw logits; a row whose
    grammar allows nothing at all keeps its raw logits."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 6] = 10.0  # the raw favourite, which no grammar below allows
    params = [Params(temperature=0, min_tokens=2), Params(temperature=0.9, min_tokens=2, seed=3),
              Params(temperature=0, min_tokens=2)]
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    allowed[:2, 0] = True  # the grammar is complete: only EOS (id 0) may follow
    histories = [history([1, 2], [9])] * 3
    batch = SamplingBatch.build(params, [None, 3, None], VOCAB, histories=histories, eos_token_ids=(0,),
                                allowed=allowed)
    assert sample(logits, batch, gen(0)).tolist() == [0, 0, 6]


def reference_penalties(logits, params, histories):
    """Per row, per token: HF's repetition penalty, then OpenAI's frequency / presence."""
    out = logits.clone()
    for row, (p, h) in enumerate(zip(params, histories)):
        prompt, output = h.token_ids[:h.num_prompt_tokens], h.token_ids[h.num_prompt_tokens:]
        for token in range(logits.shape[1]):
            value = out[row, token].item()
            if p.repetition_penalty not in (0, 1) and (token in prompt or token in output):
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = output.count(token)
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            out[row, token] = value
    return out


def test_penalties_match_a_per_token_reference():
    g = gen(3)
    logits = torch.randn(5, VOCAB, generator=g) * 3
    params = [Params(temperature=1, presence_penalty=0.7), Params(temperature=1, frequency_penalty=-0.4),
              Params(temperature=1, repetition_penalty=1.8), Params(temperature=1),
              Params(temperature=1, presence_penalty=-1.5, frequency_penalty=2.0, repetition_penalty=0.6)]
    histories = [history(torch.randint(VOCAB, (int(n),), generator=g).tolist(),
                         torch.randint(VOCAB, (int(m),), generator=g).tolist())
                 for n, m in [(4, 9), (7, 30), (12, 3), (5, 5), (3, 20)]]
    processed = build(params, histories).process(logits)
    torch.testing.assert_close(processed, reference_penalties(logits, params, histories))


def test_greedy_rows_see_the_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 5.0, 4.0
    params = [Params(temperature=0, frequency_penalty=1.0)]
    out = sample(logits, build(params, [history([1], [3, 3])]), gen(0))
    assert out.tolist() == [4]


def test_min_p_keeps_only_tokens_near_the_top():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs.log().expand(3000, -1).contiguous()
    batch = SamplingBatch.build([Params(temperature=1.0, min_p=0.2)] * 3000, [None] * 3000, 5)
    assert set(sample(logits, batch, gen(5)).tolist()) == {0, 1, 2}  # 0.12 >= 0.2 * 0.5 > 0.05


def test_gather_logprobs_is_log_softmax_and_top_k():
    logits = torch.randn(300, VOCAB, generator=gen(6))  # more rows than one slice
    tokens = torch.randint(VOCAB, (300,), generator=gen(7))
    ks = [i % 4 for i in range(300)]
    out = gather_logprobs(logits, tokens, ks)
    reference = logits.log_softmax(-1)
    for row in (0, 3, 257, 299):
        assert math.isclose(out[row].logprob, reference[row, tokens[row]].item(), rel_tol=1e-5)
        top = reference[row].topk(ks[row])
        assert out[row].top_ids == top.indices.tolist()
        assert out[row].top_logprobs == pytest.approx(top.values.tolist(), rel=1e-5)


def run_alone(runner, request_id, prompt, sampling, budget):
    """Drive one request through the runner, `budget` tokens per step (chunked prefill);
    return every TokenEvent it published."""
    blocks = list(range(1, 1 + -(-(len(prompt) + sampling.max_tokens) // runner.config.block_size)))
    new = [worker_pb2.NewRequestData(request_id=request_id, token_ids=prompt, num_prompt_tokens=len(prompt),
                                     block_ids=blocks, sampling=sampling)]
    computed, events = 0, []
    for step in range(200):
        todo = min(budget, len(prompt) - computed) if computed < len(prompt) else 1
        out = runner.step(worker_pb2.StepRequest(step_id=step, new_requests=new,
                                                 num_scheduled_tokens={request_id: todo}))
        new = []
        computed += todo
        for batch in out.events.values():
            events += batch
        if any(s.finish_reason for s in out.result.sampled):
            return events
    raise AssertionError("never finished")


def test_logprobs_and_prompt_logprobs_match_transformers(tiny_model_dir):
    runner = ModelRunner(RunnerConfig(model=str(tiny_model_dir), block_size=4, num_blocks=64))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = [5, 9, 11, 13, 40, 41, 42, 7, 8, 100, 3]
    sampling = Params(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    events = run_alone(runner, "r", prompt, sampling, budget=4)  # three prefill chunks
    output = [t for e in events for t in e.token_ids]
    prompt_lps = {e.prompt_index + i: lp for e in events for i, lp in enumerate(e.prompt_logprobs or [])}
    assert sorted(prompt_lps) == list(range(1, len(prompt)))
    with torch.no_grad():
        reference = hf(torch.tensor([prompt + output])).logits[0].log_softmax(-1)
    for position, lp in prompt_lps.items():
        row = reference[position - 1]
        assert lp.logprob == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        assert lp.top_ids == row.topk(2).indices.tolist()
    sampled = [lp for e in events for lp in e.logprobs or []]
    assert len(sampled) == len(output) == 5
    for i, (token, lp) in enumerate(zip(output, sampled)):
        row = reference[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert lp.top_ids[0] == token  # greedy: the sampled token is the most likely
        assert lp.top_logprobs == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
