"""Driving a ModelRunner without the scheduler service: a minimal scheduler, chunked
prefill logits, and transformers' greedy generate() as the reference; for images, an
in-memory media source and the placeholder runs of a processor's input_ids."""

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from gateway.media.store import content_hash
from kvstore.kv_cache_groups import group_layers
from proto import worker_pb2
from proto.messages import MediaItem
from worker_svc.config import RunnerConfig
from vision.media_source import MISSING, MediaUnavailableError
from modeling.registry import load_config
from worker_svc.model_runner import ModelRunner
from worker_svc.request_state import RequestState, split_groups


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


class MiniScheduler:
    """Just enough of a scheduler to drive ModelRunner: FCFS, a per-step token budget
    (long prompts are chunked; a chunk that would end inside an image ends at its start
    instead, or takes the whole image when it starts there, as the real scheduler keeps an
    image in one step), scattered block ids from a shuffled free list, and recompute
    preemption on demand. Requests may carry images (mm_inputs), sampling settings, and
    fail with "error" (token id -1: none appended; the error kept in `errors`); each
    request's sampled-token logprobs are kept in `logprobs`, its prompt logprobs by
    position in `prompt_logprobs` (the first sent kept), every step's StepOutput in
    `outputs_seen` and its chunks, {request id: (first position, tokens)}, in `chunks`."""

    def __init__(self, runner: ModelRunner, block_size: int, num_blocks: int, token_budget: int):
        self.runner, self.block_size, self.budget = runner, block_size, token_budget
        self.free = list(range(runner.kv_cache.num_blocks))  # num_blocks in each KV cache group
        random.Random(0).shuffle(self.free)
        self.reqs: dict[str, dict] = {}
        self.forget: list[str] = []
        self.step_id = 0
        self.errors: dict[str, str] = {}
        self.logprobs: dict[str, list] = {}
        self.prompt_logprobs: dict[str, dict] = {}
        self.outputs_seen: list = []  # every step's StepOutput
        self.chunks: list[dict[str, tuple[int, int]]] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int,
            mm_inputs: Sequence[worker_pb2.MultiModalInput] = (), **sampling) -> None:
        self.reqs[rid] = dict(tokens=list(prompt), num_prompt=len(prompt), computed=0,
                              blocks=[], sent=False, done=None, paused=False,
                              max_tokens=max_tokens, mm_inputs=list(mm_inputs), sampling=sampling)
        self.logprobs[rid] = []
        self.prompt_logprobs[rid] = {}

    def _chunk(self, r: dict, budget: int) -> int:
        """Tokens to compute now: up to the budget, never ending inside an image."""
        start = r["computed"]
        n = min(len(r["tokens"]) - start, budget)
        for m in r["mm_inputs"]:
            if m.offset < start + n < m.offset + m.length:
                n = m.offset - start if m.offset > start else (m.offset + m.length - start)
                return n if n <= budget else 0
        return n

    def done(self) -> bool:
        return all(r["done"] for r in self.reqs.values())

    def preempt(self, rid: str) -> None:
        r = self.reqs[rid]
        self.free.extend(r["blocks"])
        r.update(computed=0, blocks=[], sent=False, paused=True)
        self.forget.append(rid)

    def resume(self, rid: str) -> None:
        self.reqs[rid]["paused"] = False

    def step(self) -> worker_pb2.StepResult:
        req = worker_pb2.StepRequest(step_id=self.step_id, finished_request_ids=self.forget)
        self.forget = []
        budget = self.budget
        self.chunks.append({})
        for rid, r in self.reqs.items():
            if r["done"] or r["paused"] or budget == 0:
                continue
            n = self._chunk(r, budget)
            if n == 0:
                continue
            budget -= n
            # one table per KV cache group (every block kept: a window's holes are the kvstore's)
            groups = self.runner.kv_layout.num_groups
            need = -(-(r["computed"] + n) // self.block_size) - len(r["blocks"]) // groups
            new_blocks = [[self.free.pop() for _ in range(max(need, 0))] for _ in range(groups)]
            old = len(r["blocks"]) // groups
            r["blocks"] = [b for g in range(groups) for b in r["blocks"][g * old:(g + 1) * old] + new_blocks[g]]
            new_blocks = [b for ids in new_blocks for b in ids]
            if not r["sent"]:
                req.new_requests.add(
                    request_id=rid, token_ids=r["tokens"], num_prompt_tokens=r["num_prompt"],
                    block_ids=r["blocks"], num_computed_tokens=r["computed"],
                    sampling=worker_pb2.SamplingParams(**{"max_tokens": r["max_tokens"], "temperature": 0.0,
                                                          **r["sampling"]}),
                    reply_channel=f"chan-{rid[-1]}", mm_inputs=r["mm_inputs"])
                r["sent"] = True
            else:
                req.cached_requests.add(request_id=rid, new_block_ids=new_blocks,
                                        num_computed_tokens=r["computed"])
            req.num_scheduled_tokens[rid] = n
            self.chunks[-1][rid] = (r["computed"], n)
            r["computed"] += n
        self.step_id += 1
        output = self.runner.step(req)
        self.outputs_seen.append(output)
        for s in output.result.sampled:
            r = self.reqs[s.request_id]
            if s.token_id >= 0:  # -1: failed without a token
                r["tokens"].append(s.token_id)
            if s.finish_reason:
                r["done"] = s.finish_reason
                self.free.extend(r["blocks"])
                r["blocks"] = []
                self.forget.append(s.request_id)
        # events mirror the sampled tokens, grouped by reply channel, indexed by output position
        flat = [e for evs in output.events.values() for e in evs]
        assert len([e for e in flat if e.token_ids or e.finish_reason]) == len(output.result.sampled)
        for e in flat:
            r = self.reqs[e.request_id]
            if e.finish_reason == "error" and not e.token_ids:
                self.errors[e.request_id] = e.error
                continue
            for i, lp in enumerate(e.prompt_logprobs or ()):
                self.prompt_logprobs[e.request_id].setdefault(e.prompt_index + i, lp)
            if not e.token_ids:
                continue  # prompt logprobs of a chunk that sampled nothing
            assert r["tokens"][r["num_prompt"] + e.index] == e.token_ids[0]
            if e.logprobs:
                self.logprobs[e.request_id].extend(e.logprobs)
        return output.result

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if self.done():
                return
            self.step()
        raise AssertionError(f"requests unfinished after {max_steps} steps")

    def outputs(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        return r["tokens"][r["num_prompt"]:]


def make_runner(model_dir, block_size=4, num_blocks=96, media=None, **config) -> ModelRunner:
    """A runner with `num_blocks` blocks for each of its model's KV cache groups (None: sized
    from the memory the config gives)."""
    groups = group_layers(load_config(Path(model_dir)).sliding_windows).num_groups
    return ModelRunner(RunnerConfig(model=str(model_dir), block_size=block_size,
                                    num_blocks=num_blocks and num_blocks * groups,
                                    **config), media=media)


class FakeMediaSource:
    """vision.media_source.MediaSource in memory: `put` stores an item under its content
    hash (the gateway's rule); `fetches` lists the hashes of each fetch."""

    def __init__(self) -> None:
        self.items: dict[str, MediaItem] = {}
        self.fetches: list[list[str]] = []

    def put(self, item: MediaItem) -> str:
        digest = content_hash(item)
        self.items[digest] = item
        return digest

    def fetch(self, hashes):
        self.fetches.append(list(hashes))
        found = {h: self.items[h] for h in hashes if h in self.items}
        if len(found) < len(hashes):
            raise MediaUnavailableError({h: MISSING for h in hashes if h not in found}, found)
        return found


def image_runs(input_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `image_token_id` in a processor's input_ids: the
    placeholder ranges the gateway sends (mm_inputs)."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(input_ids):
        if t == image_token_id:
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs


def mm_inputs(input_ids: Sequence[int], image_token_id: int,
              hashes: Sequence[str]) -> list[worker_pb2.MultiModalInput]:
    runs = image_runs(input_ids, image_token_id)
    assert len(runs) == len(hashes), f"{len(runs)} images in the prompt, {len(hashes)} hashes"
    return [worker_pb2.MultiModalInput(content_hash=h, offset=o, length=n) for (o, n), h in zip(runs, hashes)]


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, 1536) for _ in range(n)] for n in lengths]


def grouped_block_ids(runner: ModelRunner, block_ids: list[int]) -> list[int]:
    """A step's block ids for a request whose table in each of the runner's KV cache groups
    is `block_ids` shifted past the previous group's (distinct blocks per group)."""
    span = max(block_ids) + 1
    num_groups = runner.kv_layout.num_groups
    assert num_groups * span <= runner.kv_cache.num_blocks, (
        f"{num_groups} groups x {span} blocks: more than the runner's {runner.kv_cache.num_blocks}")
    return [b + g * span for g in range(num_groups) for b in block_ids]


def runner_state(runner: ModelRunner, new: worker_pb2.NewRequestData) -> RequestState:
    """A request's state with its row in the runner's persistent batch (as a step adds one)."""
    state = RequestState(new)
    state.row = runner.inputs.add(new.sampling, split_groups(new.block_ids, runner.kv_layout.num_groups))
    return state


def flat_batch(runner: ModelRunner, scheduled: list[tuple[RequestState, int]]):
    """The runner's FlatBatch of `scheduled` (request, tokens), as its step builds it."""
    return runner.inputs.prepare(scheduled, runner.plan_attention, runner.kv_layout.windows)


def chunked_prefill_logits(runner: ModelRunner, prompt: list[int], chunks: list[int],
                           block_ids: list[int]) -> torch.Tensor:
    """Logits of every prompt row, computed chunk by chunk through the paged cache (in
    every KV cache group, a table shaped as `block_ids`: grouped_block_ids)."""
    state = runner_state(runner, worker_pb2.NewRequestData(
        request_id="x", token_ids=prompt, num_prompt_tokens=len(prompt),
        block_ids=grouped_block_ids(runner, block_ids)))
    got = []
    for n in chunks:
        batch = flat_batch(runner, [(state, n)])
        with torch.inference_mode():
            got.append(runner.model(batch.input_ids, batch.positions, batch.attn,
                                    (runner.kv_cache.k_caches, runner.kv_cache.v_caches),
                                    torch.arange(n, device=runner.device)))
        state.num_computed_tokens += n
    return torch.cat(got)
