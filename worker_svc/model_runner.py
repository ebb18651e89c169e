"""ModelRunner: the worker's compute core. A StepRequest in, sampled tokens out.

No transport here (the gRPC server and Redis publishing wrap it). One step:

1. forget `finished_request_ids` (finished, aborted, preempted requests);
2. add `new_requests` (full state) and apply `cached_requests` (new block ids; the
   scheduler's num_computed_tokens must equal ours, else the two disagree about the cache);
3. build the flat batch of `num_scheduled_tokens` (worker_svc/batch.py), run the model
   (K/V written into the paged cache, paged attention), logits only for requests that
   catch up with their token list;
4. sample one token for each of those, append it, apply the finish rule (worker_svc/stop.py);
5. return a SampledToken per sampled token, and a TokenEvent per token grouped by the
   request's reply channel.

Requests that finished keep their state until the scheduler forgets them, but are never
computed or sampled again (a scheduler that still lists them gets nothing for them).
"""

import functools
import time
from dataclasses import dataclass

import torch

from kernels.backend import get_attention_backend
from kvstore.cache_tensors import KVCacheTensors, num_blocks_for_memory
from proto import worker_pb2
from proto.messages import TokenEvent
from worker_svc.batch import build_flat_batch
from worker_svc.config import RunnerConfig
from worker_svc.model.config import DecoderConfig
from worker_svc.model.loader import load_model, resolve_dtype
from worker_svc.request_state import RequestState
from worker_svc.sampler import SamplingBatch, sample
from worker_svc.stop import finish_reason


class StepConsistencyError(RuntimeError):
    """The scheduler's view of a request disagrees with the worker's."""


@dataclass(frozen=True)
class StepOutput:
    result: worker_pb2.StepResult
    events: dict[str, list[TokenEvent]]  # reply channel → that channel's events this step


class ModelRunner:
    def __init__(self, config: RunnerConfig, worker_id: str = ""):
        self.config = config
        self.worker_id = worker_id
        self.device = torch.device(config.device)
        self.model_config = DecoderConfig.from_dir(config.model)
        cfg = self.model_config
        self.dtype = resolve_dtype(config.dtype, cfg)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.backend = get_attention_backend(config.attention_backend, self.device)
        # scratch memory of the attention backend, kept for the runner's life
        self.plan_attention = functools.partial(self.backend.plan,
                                                workspace=self.backend.new_workspace())
        self.model = load_model(config.model, cfg, self.backend, self.max_model_len,
                                self.dtype, self.device)
        num_blocks = config.num_blocks or num_blocks_for_memory(
            config.kv_cache_memory_bytes, cfg.num_layers, config.block_size,
            cfg.num_kv_heads, cfg.head_dim, self.dtype)
        self.kv_cache = KVCacheTensors(cfg.num_layers, num_blocks, config.block_size,
                                       cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.requests: dict[str, RequestState] = {}

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    def describe(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id, model=self.config.model_name,
            block_size=self.config.block_size, num_blocks=self.kv_cache.num_blocks,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
        )

    def _update_states(self, request: worker_pb2.StepRequest) -> None:
        for request_id in request.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in request.new_requests:
            self.requests[new.request_id] = RequestState(new, self.device)
        for cached in request.cached_requests:
            state = self.requests.get(cached.request_id)
            if state is None:
                raise StepConsistencyError(
                    f"step {request.step_id}: cached request {cached.request_id!r} is unknown "
                    f"to this worker (never added, or already forgotten)")
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise StepConsistencyError(
                    f"step {request.step_id}: request {cached.request_id!r} has "
                    f"num_computed_tokens={state.num_computed_tokens} on the worker, "
                    f"the scheduler says {cached.num_computed_tokens}")
            state.block_ids.extend(cached.new_block_ids)

    def step(self, request: worker_pb2.StepRequest) -> StepOutput:
        start = time.perf_counter()
        self._update_states(request)
        scheduled = []
        for request_id, n in request.num_scheduled_tokens.items():
            state = self.requests.get(request_id)
            if state is None:
                raise StepConsistencyError(
                    f"step {request.step_id}: scheduled request {request_id!r} is unknown")
            if state.finish_reason is None:
                scheduled.append((state, n))
        result = worker_pb2.StepResult(step_id=request.step_id)
        events: dict[str, list[TokenEvent]] = {}
        if scheduled:
            with torch.inference_mode():
                sampled = self._execute(scheduled)
            for state, token_id in sampled:
                reason = self._append(state, token_id)
                result.sampled.add(request_id=state.request_id, token_id=token_id,
                                   finish_reason=reason or "")
                events.setdefault(state.reply_channel, []).append(TokenEvent(
                    request_id=state.request_id, index=state.num_output_tokens - 1,
                    token_ids=[token_id], finish_reason=reason))
        result.execute_seconds = time.perf_counter() - start
        return StepOutput(result=result, events=events)

    def _execute(self, scheduled: list[tuple[RequestState, int]]) -> list[tuple[RequestState, int]]:
        """Forward the flat batch, advance num_computed_tokens, sample; (request, token)."""
        batch = build_flat_batch(scheduled, self.config.block_size, self.plan_attention,
                                 self.device)
        logits = self.model(batch.input_ids, batch.positions, batch.attn,
                            (self.kv_cache.k_caches, self.kv_cache.v_caches), batch.logits_indices)
        for state, n in scheduled:
            state.num_computed_tokens += n
        if not batch.sampling_requests:
            return []
        reqs = batch.sampling_requests
        sampling = SamplingBatch.build([r.sampling for r in reqs], [r.generator for r in reqs],
                                       self.model_config.vocab_size, self.device)
        token_ids = sample(logits, sampling, self.generator).tolist()
        return list(zip(reqs, token_ids))

    def _append(self, state: RequestState, token_id: int) -> str | None:
        state.token_ids.append(token_id)
        state.finish_reason = finish_reason(
            state.sampling, state.num_output_tokens, token_id, self.model_config.eos_token_ids,
            state.num_tokens, self.max_model_len)
        return state.finish_reason
