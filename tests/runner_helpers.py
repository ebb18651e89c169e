"""Driving a ModelRunner without the scheduler service: a minimal scheduler, chunked
prefill logits, and transformers' greedy generate() as the reference."""

import random

import torch

from proto import worker_pb2
from worker_svc.batch import build_flat_batch
from worker_svc.config import RunnerConfig
from worker_svc.model_runner import ModelRunner
from worker_svc.request_state import RequestState


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


class MiniScheduler:
    """Just enough of a scheduler to drive ModelRunner: FCFS, a per-step token budget
    (long prompts are chunked), scattered block ids from a shuffled free list, and
    recompute preemption on demand."""

    def __init__(self, runner: ModelRunner, block_size: int, num_blocks: int, token_budget: int):
        self.runner, self.block_size, self.budget = runner, block_size, token_budget
        self.free = list(range(num_blocks))
        random.Random(0).shuffle(self.free)
        self.reqs: dict[str, dict] = {}
        self.forget: list[str] = []
        self.step_id = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.reqs[rid] = dict(tokens=list(prompt), num_prompt=len(prompt), computed=0,
                              blocks=[], sent=False, done=None, paused=False,
                              max_tokens=max_tokens)

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
        for rid, r in self.reqs.items():
            if r["done"] or r["paused"] or budget == 0:
                continue
            n = min(len(r["tokens"]) - r["computed"], budget)
            budget -= n
            need = -(-(r["computed"] + n) // self.block_size) - len(r["blocks"])
            new_blocks = [self.free.pop() for _ in range(max(need, 0))]
            r["blocks"] += new_blocks
            if not r["sent"]:
                req.new_requests.add(
                    request_id=rid, token_ids=r["tokens"], num_prompt_tokens=r["num_prompt"],
                    block_ids=r["blocks"], num_computed_tokens=r["computed"],
                    sampling=worker_pb2.SamplingParams(max_tokens=r["max_tokens"], temperature=0.0),
                    reply_channel=f"chan-{rid[-1]}")
                r["sent"] = True
            else:
                req.cached_requests.add(request_id=rid, new_block_ids=new_blocks,
                                        num_computed_tokens=r["computed"])
            req.num_scheduled_tokens[rid] = n
            r["computed"] += n
        self.step_id += 1
        output = self.runner.step(req)
        for s in output.result.sampled:
            r = self.reqs[s.request_id]
            r["tokens"].append(s.token_id)
            if s.finish_reason:
                r["done"] = s.finish_reason
                self.free.extend(r["blocks"])
                r["blocks"] = []
                self.forget.append(s.request_id)
        # events mirror the sampled tokens, grouped by reply channel, indexed by output position
        flat = [e for evs in output.events.values() for e in evs]
        assert len(flat) == len(output.result.sampled)
        for e in flat:
            r = self.reqs[e.request_id]
            assert r["tokens"][r["num_prompt"] + e.index] == e.token_ids[0]
        return output.result

    def outputs(self, rid: str) -> list[int]:
        r = self.reqs[rid]
        return r["tokens"][r["num_prompt"]:]


def make_runner(model_dir, block_size=4, num_blocks=96, **config) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=str(model_dir), block_size=block_size, num_blocks=num_blocks,
                                    **config))


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, 1536) for _ in range(n)] for n in lengths]


def chunked_prefill_logits(runner: ModelRunner, prompt: list[int], chunks: list[int],
                           block_ids: list[int]) -> torch.Tensor:
    """Logits of every prompt row, computed chunk by chunk through the paged cache."""
    state = RequestState(worker_pb2.NewRequestData(
        request_id="x", token_ids=prompt, num_prompt_tokens=len(prompt), block_ids=block_ids),
        runner.device)
    got = []
    for n in chunks:
        batch = build_flat_batch([(state, n)], runner.config.block_size, runner.backend.plan,
                                 runner.device, runner.model.windows)
        with torch.inference_mode():
            got.append(runner.model(batch.input_ids, batch.positions, batch.attn,
                                    (runner.kv_cache.k_caches, runner.kv_cache.v_caches),
                                    torch.arange(n)))
        state.num_computed_tokens += n
    return torch.cat(got)
