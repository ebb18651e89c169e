"""worker_svc/input_batch.py: the persistent batch against a plain model of what a step
must hold, over random sequences of requests joining, growing, being replaced, swapped
out and leaving. Run with the device's copy kept apart from the host's (the GPU's
bookkeeping: table diffs shipped and scattered, graph buffers padded, the rows grown past
their first allocation) and shared (the CPU's)."""

import random

import numpy as np
import pytest
import torch

from proto import worker_pb2
from worker_svc.input_batch import DUMMY_ROW, InputBatch
from worker_svc.request_state import RequestState
from worker_svc.sampler import position_seed

BLOCK, WIDTH, GROUPS, VOCAB = 4, 12, 2, 50


def no_plan(block_tables, seq_lens, query_start_loc, block_size, window, bidir_spans=None, host=None):
    """No plan; checks the lengths the batch hands a plan on the host (kernels/host_layout.py)
    against the tensors (the device's copy, where it is apart)."""
    assert host.seq_lens.tolist() == seq_lens.tolist()
    assert host.query_start_loc.tolist() == query_start_loc.tolist()
    assert host.max_seq_len == max(seq_lens.tolist(), default=1)
    if host.block_ids_below is not None:
        assert 0 <= block_tables.min() and block_tables.max() < host.block_ids_below
    return None


class Model:
    """The truth: each request's tables and tokens, kept in plain lists."""

    def __init__(self, inputs: InputBatch, seed: int):
        self.inputs, self.rnd = inputs, random.Random(seed)
        self.states: dict[str, RequestState] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.count = 0

    def blocks(self, n: int) -> list[list[int]]:
        return [[self.rnd.randrange(1, 500) for _ in range(n)] for _ in range(GROUPS)]

    def add(self) -> None:
        self.count += 1
        rid = f"r{self.count}"
        tokens = [self.rnd.randrange(VOCAB) for _ in range(self.rnd.randrange(2, 30))]
        computed = self.rnd.randrange(len(tokens))
        tables = self.blocks(-(-len(tokens) // BLOCK))
        new = worker_pb2.NewRequestData(request_id=rid, token_ids=tokens, num_prompt_tokens=len(tokens),
                                        num_computed_tokens=computed,
                                        sampling=worker_pb2.SamplingParams(temperature=self.rnd.choice([0.0, 0.7]),
                                                                           top_k=self.rnd.choice([0, 5])))
        if self.rnd.random() < 0.5:  # a seeded request, over the whole int64 range
            new.sampling.seed = self.rnd.randrange(-2**63, 2**63)
        self.states[rid] = RequestState(new, row=self.inputs.add(new.sampling, tables))
        self.tables[rid] = tables

    def change(self) -> None:
        rid = self.rnd.choice(sorted(self.states))
        state, what = self.states[rid], self.rnd.random()
        if what < 0.25:
            self.inputs.remove(state.row)
            del self.states[rid], self.tables[rid]
        elif what < 0.5:  # replaced (swapped in, copied on write): a whole new table
            tables = self.blocks(len(self.tables[rid][0]))
            self.inputs.set_blocks(state.row, tables, replace=True)
            self.tables[rid] = tables
        else:  # decoding on: a token, and a block when the table is full
            state.token_ids.append(self.rnd.randrange(VOCAB))
            if len(state.token_ids) > len(self.tables[rid][0]) * BLOCK and len(self.tables[rid][0]) < WIDTH:
                more = self.blocks(1)
                self.inputs.set_blocks(state.row, more, replace=False)
                for g in range(GROUPS):
                    self.tables[rid][g] += more[g]
            state.num_computed_tokens = min(len(state.token_ids) - 1, len(self.tables[rid][0]) * BLOCK - 1)
            del state.token_ids[state.num_computed_tokens + 1:]

    def check(self, scheduled, batch, pad_to=None) -> None:
        ids, positions, slots = [], [], [[] for _ in range(GROUPS)]
        for state, n in scheduled:
            start = state.num_computed_tokens
            for p in range(start, start + n):
                ids.append(state.token_ids[p])
                positions.append(p)
                for g in range(GROUPS):
                    slots[g].append(self.tables[state.request_id][g][p // BLOCK] * BLOCK + p % BLOCK)
        t, r = len(ids), len(scheduled)
        assert batch.input_ids[:t].tolist() == ids and batch.positions[:t].tolist() == positions
        qsl = np.cumsum([0] + [n for _, n in scheduled]).tolist()
        assert batch.attn.query_start_loc[:r + 1].tolist() == qsl
        assert batch.attn.seq_lens[:r].tolist() == [s.num_computed_tokens + n for s, n in scheduled]
        for g, group in enumerate(batch.attn.groups):
            assert group.slot_mapping[:t].tolist() == slots[g]
            for i, (state, n) in enumerate(scheduled):
                used = -(-(state.num_computed_tokens + n) // BLOCK)
                assert group.block_tables[i, :used].tolist() == self.tables[state.request_id][g][:used]
        samplers = [s for s, n in scheduled if s.num_computed_tokens + n == len(s.token_ids)]
        assert list(batch.sampling_requests) == samplers
        assert batch.logits_indices[:len(samplers)].tolist() == [
            qsl[i + 1] - 1 for i, (s, n) in enumerate(scheduled) if s in samplers]
        if samplers:
            greedy = [s.sampling.temperature == 0 for s in samplers]
            assert batch.sampling.all_greedy == all(greedy)
            if not all(greedy):  # (an all-greedy step stages no settings: none is read)
                assert batch.sampling.greedy.tolist() == greedy
                drawn = [s.sampling.temperature for s in samplers if s.sampling.temperature]
                assert batch.sampling.temperatures[:len(greedy)][~batch.sampling.greedy.bool()].tolist() == \
                    pytest.approx(drawn)
                assert batch.sampling.any_greedy == any(greedy)
                seeded = [s.sampling.HasField("seed") for s in samplers]
                seeds = batch.sampling.seeds
                assert (seeds is None) == (not any(seeded))
                if seeds is not None:  # each seeded row's seed for the position it samples now
                    assert seeds.own.bool().tolist() == seeded
                    assert [int(b) & (2**64 - 1) for b, own in zip(seeds.bits.tolist(), seeded) if own] == [
                        position_seed(s.sampling.seed, s.num_output_tokens) for s in samplers
                        if s.sampling.HasField("seed")]
        if pad_to is not None:  # padding: row 0's tables, position 0, context 1, K/V nowhere
            assert len(batch.input_ids) == pad_to == len(batch.attn.seq_lens)
            assert batch.positions[t:].tolist() == [0] * (pad_to - t)
            assert batch.attn.seq_lens[r:].tolist() == [1] * (pad_to - r)
            assert batch.attn.query_start_loc.tolist() == list(range(pad_to + 1))
            for group in batch.attn.groups:
                assert group.slot_mapping[t:].tolist() == [-1] * (pad_to - t)
                assert not group.block_tables[r:].any()
            assert batch.logits_indices.tolist() == list(range(pad_to))


@pytest.mark.parametrize("separate", [True, False], ids=["gpu-bookkeeping", "cpu"])
@pytest.mark.parametrize("seed", range(4))
def test_steps_hold_what_the_requests_hold(separate, seed):
    inputs = InputBatch(GROUPS, BLOCK, WIDTH, VOCAB, torch.device("cpu"), graph_capacity=8, rows=4,
                        separate_device_memory=separate)
    model = Model(inputs, seed)
    for step in range(120):
        for _ in range(model.rnd.randrange(3)):
            model.add()
        for _ in range(model.rnd.randrange(6)):
            if model.states:
                model.change()
        if not model.states:
            continue
        states = list(model.states.values())
        model.rnd.shuffle(states)
        if step % 3 == 0:  # a pure-decode step, padded as a graph replays it
            decodes = [(s, 1) for s in states if s.num_computed_tokens + 1 == len(s.token_ids)][:8]
            if decodes:
                pad = model.rnd.choice([b for b in (1, 2, 4, 8) if b >= len(decodes)])
                model.check(decodes, inputs.prepare(decodes, no_plan, (None, 8), pad_to=pad), pad)
            continue
        chosen = [(s, model.rnd.randrange(1, len(s.token_ids) - s.num_computed_tokens + 1))
                  for s in states[:model.rnd.randrange(1, len(states) + 1)]]
        model.check(chosen, inputs.prepare(chosen, no_plan, (None, 8)))
    assert inputs.num_rows > 4  # grown past the first allocation


def test_block_ids_outside_the_cache_are_refused_as_they_are_set():
    """Once the cache's size is known, each id is checked as it is written: a step's plan
    takes the bound instead of scanning the tables (kernels/host_layout.py)."""
    inputs = InputBatch(GROUPS, BLOCK, WIDTH, VOCAB, torch.device("cpu"), graph_capacity=2)
    model = Model(inputs, 3)
    model.add()
    with pytest.raises(ValueError, match="outside the cache's 7"):
        inputs.limit_block_ids(7)  # the tables already name blocks up to 499
    inputs.limit_block_ids(500)
    state = next(iter(model.states.values()))
    for bad in (500, -1):
        with pytest.raises(ValueError, match=f"block id {bad} is outside the KV cache's 500 blocks"):
            inputs.set_blocks(state.row, [[1], [bad]], replace=False)
    seen = []
    inputs.prepare([(state, 1)], lambda *a, host=None, **k: seen.append(host.block_ids_below), (None, 8))
    assert seen == [500, 500]
    free = list(inputs._free)
    with pytest.raises(ValueError, match="block id 600"):  # a new request's table: refused, its row stays free
        inputs.add(worker_pb2.SamplingParams(), [[1], [600]])
    assert inputs._free == free


def test_a_graph_step_after_many_replaced_tables():
    """More table diffs than the graph buffers take go ahead on their own."""
    inputs = InputBatch(GROUPS, BLOCK, WIDTH, VOCAB, torch.device("cpu"), graph_capacity=2,
                        separate_device_memory=True)
    model = Model(inputs, 9)
    for _ in range(6):
        model.add()
    for rid, state in model.states.items():
        tables = model.blocks(WIDTH)
        inputs.set_blocks(state.row, tables, replace=True)
        model.tables[rid] = tables
        state.num_computed_tokens = len(state.token_ids) - 1
    decodes = [(s, 1) for s in list(model.states.values())[:2]]
    model.check(decodes, inputs.prepare(decodes, no_plan, (None, 8), pad_to=2), 2)


def test_bad_steps_are_refused():
    inputs = InputBatch(1, BLOCK, WIDTH, VOCAB, torch.device("cpu"), graph_capacity=2)
    new = worker_pb2.NewRequestData(request_id="a", token_ids=list(range(10)), num_prompt_tokens=10)
    state = RequestState(new, row=inputs.add(new.sampling, [[1, 2]]))
    assert state.row != DUMMY_ROW
    with pytest.raises(ValueError, match="10 tokens need 3 blocks, its block table has 2"):
        inputs.prepare([(state, 10)], no_plan, (None,))
    with pytest.raises(ValueError, match="cannot compute 11 tokens"):
        inputs.prepare([(state, 11)], no_plan, (None,))
    with pytest.raises(ValueError, match="pure-decode batch"):
        inputs.prepare([(state, 2)], no_plan, (None,), pad_to=2)
    with pytest.raises(ValueError, match="wider than the 12 blocks"):
        inputs.set_blocks(state.row, [list(range(13))], replace=True)


def test_a_row_reused_by_another_request_stages_its_own_settings():
    """The settings staged for the same rows are kept from one step to the next (only the
    seeds move on); a row freed and taken by a request of other settings is staged anew."""
    inputs = InputBatch(1, BLOCK, WIDTH, VOCAB, torch.device("cpu"))

    def state(rid, temperature, seed):
        params = worker_pb2.SamplingParams(temperature=temperature, top_k=3, seed=seed)
        new = worker_pb2.NewRequestData(request_id=rid, token_ids=[1, 2, 3], num_prompt_tokens=3,
                                        num_computed_tokens=2, sampling=params)
        return RequestState(new, row=inputs.add(params, [[1]]))

    a, b = state("a", 0.5, 11), state("b", 0.0, 12)
    first = inputs.prepare([(a, 1), (b, 1)], no_plan, (None,)).sampling
    assert first.temperatures.tolist() == [0.5, 1.0] and first.greedy.tolist() == [False, True]
    bits = first.seeds.bits.tolist()
    for s in (a, b):  # a token on: the same rows, the next position
        s.token_ids.append(5)
        s.num_computed_tokens += 1
    again = inputs.prepare([(a, 1), (b, 1)], no_plan, (None,)).sampling
    assert again.temperatures.tolist() == [0.5, 1.0]
    assert [int(x) & (2**64 - 1) for x in again.seeds.bits.tolist()] == [position_seed(11, 1), position_seed(12, 1)]
    assert again.seeds.bits.tolist() != bits
    inputs.remove(b.row)
    c = state("c", 0.25, 13)
    assert c.row == b.row  # the same rows as the step before ...
    third = inputs.prepare([(a, 1), (c, 1)], no_plan, (None,)).sampling
    assert third.temperatures.tolist() == [0.5, 0.25] and third.greedy.tolist() == [False, False]  # ... staged anew
    assert [int(x) & (2**64 - 1) for x in third.seeds.bits.tolist()] == [position_seed(11, 1), position_seed(13, 0)]
