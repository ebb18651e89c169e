"""ModelRunner: the worker's compute core. A StepRequest in, sampled tokens out.

No transport here (the gRPC server and Redis publishing wrap it). One step:

0. swap out `blocks_to_swap_out` (GPU -> the CPU swap space) and drop the block tables of
   `swapped_out_request_ids` (their state stays: they resume where they stopped);
1. forget `finished_request_ids` (finished, aborted, preempted requests);
2. add `new_requests` (full state) and apply `cached_requests` (new block ids, or a whole
   new table with replace_block_ids; the scheduler's num_computed_tokens must equal ours,
   else the two disagree about the cache); then swap in `blocks_to_swap_in` (CPU -> GPU)
   and copy `blocks_to_copy` (copy-on-write), in that order (proto/worker.proto);
3. build the flat batch of `num_scheduled_tokens` (worker_svc/batch.py), run the model
   (K/V written into the paged cache, paged attention), logits only for requests that
   catch up with their token list; when the chunks hold image soft tokens, the images'
   embeddings (encoder cache, or fetched and encoded now: worker_svc/vision_step.py) are
   written over those rows of the input embeddings, and each image's rows see each other
   both ways (the batch's bidir_spans);
4. sample one token for each of those, append it, apply the finish rule (worker_svc/stop.py);
   logprobs of sampled tokens, and of prompt tokens for requests that ask (worker_svc/logprobs.py);
5. return a SampledToken per sampled token, and a TokenEvent per token (or per prompt-logprobs
   chunk) grouped by the request's reply channel; the event of a request's first output
   token also carries the prompt tokens it took from the prefix cache (num_cached_tokens).

Requests that finished keep their state until the scheduler forgets them, but are never
computed or sampled again (a scheduler that still lists them gets nothing for them).

A step is `launch`ed (steps 0-4, up to the sampled ids on the device, their copy to the
host started) and then `finish`ed (5: the ids read, appended, the result and events made);
`step` is both. The worker service launches a step planned ahead before finishing the one
in flight where `can_launch_ahead` allows (worker_svc/server.py): a token that step sampled
is then in flight (num_computed_tokens == len(token_ids)), and the new step reads it from
the device (InputBatch.prepare's ahead_ids), so the host prepares step k+1 while the
device runs step k. A request that step k finishes is then computed once more by k+1, for
nothing: k+1's finish gives it nothing.

A request that cannot run here -- images on a worker without a vision encoder or media
source, placeholder ranges that are not the model's, an image expired from the media store
or undecodable -- fails alone, in the step it is scheduled in, without being computed: an
error TokenEvent to its reply channel, and a SampledToken with finish_reason "error" and
token_id NO_TOKEN_ID (there is none; it may come in a step that samples nothing for the
request). The step and the other requests go on.

This module holds the runner: what it loads (the model, the KV cache and its swap space,
the decode graphs) and a step's launch (swaps and copies, images, the forward, sampling).
The requests it holds, and steps 1-2's changes to them, are worker_svc/held_requests.py's;
step 5, the finished step's tokens and events, is worker_svc/step_output.py's.
"""

import functools
import logging
import time
from collections.abc import Callable

import torch

from kernels.backend import get_attention_backend
from kvstore.cache_tensors import KVCacheTensors, num_blocks_for_memory, resolve_kv_cache_dtype, swap_blocks
from kvstore.kv_cache_groups import kv_capacity
from modeling.cpu_threads import CpuShare, choose_threads
from modeling.dummy_weights import check_config
from modeling.loader import load_model, resolve_dtype
from modeling.registry import load_config, load_vision_config
from proto import worker_pb2
from proto.messages import TokenEvent
from proto.model_source import resolve_model
from vision.media_encoder import MediaEncoder
from vision.media_source import MediaSource
from vision.published_embeddings import PublishedEmbeddings
from worker_svc.config import RunnerConfig
from worker_svc.cuda_graphs import DecodeGraphs, GraphMemoryError, decode_graph_sizes
from worker_svc.grammar import GrammarCompiler
from worker_svc.held_requests import HeldRequests, StepConsistencyError
from worker_svc.input_batch import InputBatch
from worker_svc.kv_budget import kv_cache_bytes
from worker_svc.launched_step import LaunchedStep, Produced, SampledIds
from worker_svc.logits_processors import uses_edits
from worker_svc.logprobs import gather_logprobs, prompt_logprob_rows
from worker_svc.request_state import RequestState
from worker_svc.sampler import SamplingBatch, sample
from worker_svc.step_output import StepOutput, fail_request, finish_step
from worker_svc.vision_step import ImageEmbedder, place_step_images

log = logging.getLogger(__name__)


class ModelRunner:
    """`media`: where image requests' media are read (vision/media_source.py); with
    None, or a text-only checkpoint, the runner serves text and fails image requests.
    `published`: makes, from the loaded encoder, the embeddings an encoder service
    publishes (vision/published_embeddings.py), read before encoding; None: none read."""

    def __init__(self, config: RunnerConfig, worker_id: str = "", media: MediaSource | None = None,
                 published: Callable[[MediaEncoder], PublishedEmbeddings] | None = None):
        self.config = config
        self.worker_id = worker_id
        self.device = torch.device(config.device)
        self.model_dir = resolve_model(config.model)  # a folder, or a Hub id from the cache
        check_config(self.model_dir, config.load_format)
        self.model_config = load_config(self.model_dir)
        cfg = self.model_config
        # CPU compute threads (on this thread: the compute thread, whose OpenMP team they are)
        self.cpu_share: CpuShare | None = None
        if self.device.type == "cpu":
            choice = choose_threads(config.threads)
            torch.set_num_threads(choice.threads)
            log.info("compute threads: %d (%s)", choice.threads, choice.why)
            if not choice.fixed and choice.allowed > 1:
                self.cpu_share = CpuShare(choice)
                self.cpu_share.start()  # reads while the worker is idle too
        self.dtype, why = resolve_dtype(config.dtype, cfg, self.device)
        log.info("serving in %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.backend = get_attention_backend(config.attention_backend, self.device, self.dtype)
        # scratch memory of the attention backend, kept for the runner's life
        self.plan_attention = functools.partial(self.backend.plan,
                                                workspace=self.backend.new_workspace())
        # before the weights load: a cache dtype this device cannot take fails at once
        self.kv_dtype, why = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device)
        if self.kv_dtype != self.dtype:
            log.info("KV cache in %s (%s)", str(self.kv_dtype).removeprefix("torch."), why)
        self.model = load_model(self.model_dir, cfg, self.backend, self.max_model_len,
                                self.dtype, self.device, config.quantization, config.load_format)
        # before the KV cache is sized: a GPU's share counts the encoder's weights too
        self.vision_config = load_vision_config(self.model_dir)
        self.vision: ImageEmbedder | None = None
        if self.vision_config is not None and media is not None:
            self.vision = ImageEmbedder.load(self.model_dir, self.vision_config, self.dtype, self.device,
                                             media, config.encoder_cache_memory_bytes, published,
                                             config.load_format)
        # KV cache groups (kvstore/kv_cache_groups.py): a block holds `group_size` layers' K/V
        self.kv_layout = self.model.kv_layout
        slots = self.kv_layout.group_size
        # the persistent batch: each request's row of block tables and sampling settings
        graph_sizes = decode_graph_sizes(config, self.device, self.backend.name)
        self.inputs = InputBatch(self.kv_layout.num_groups, config.block_size,
                                 -(-self.max_model_len // config.block_size), cfg.vocab_size, self.device,
                                 graph_capacity=max(graph_sizes, default=0))
        kv_bytes = kv_cache_bytes(self.device, config.kv_cache_memory_bytes, config.gpu_memory_utilization)
        graph_bytes = self._graph_memory(graph_sizes)
        if config.gpu_memory_utilization and graph_bytes >= kv_bytes and not config.num_blocks:
            raise GraphMemoryError(
                f"the CUDA graphs for decode batches up to {max(graph_sizes)} need {graph_bytes / 2**30:.2f} GiB, "
                f"all of the {kv_bytes / 2**30:.2f} GiB --gpu-memory-utilization leaves for the KV cache: raise "
                "it, lower --max-cudagraph-capture-size, or run with --enforce-eager")
        num_blocks = config.num_blocks or num_blocks_for_memory(  # a share of the GPU counts the graphs
            kv_bytes - (graph_bytes if config.gpu_memory_utilization else 0), slots, config.block_size,
            cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        self.kv_cache = KVCacheTensors(slots, num_blocks, config.block_size,
                                       cfg.num_kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        self.inputs.limit_block_ids(num_blocks)
        log.info("%s; %s", self.kv_layout.describe(),
                 kv_capacity(self.kv_layout, num_blocks, config.block_size, self.max_model_len))
        self.graphs: DecodeGraphs | None = None
        if graph_sizes:
            self.graphs = DecodeGraphs(self.model, self.inputs, (self.kv_cache.k_caches, self.kv_cache.v_caches),
                                       self.plan_attention, self.kv_layout.windows, graph_sizes)
            report = self.graphs.capture(self.device, graph_bytes)
            log.info("%s (%.0f MiB expected)", report.describe(), graph_bytes / 2**20)
        num_cpu_blocks = config.num_cpu_blocks
        if num_cpu_blocks is None:
            num_cpu_blocks = num_blocks_for_memory(
                config.swap_space_bytes, slots, config.block_size, cfg.num_kv_heads,
                cfg.head_dim, self.kv_dtype)
        # The swap space: same layout, in CPU memory (None without swap space).
        self.cpu_cache = KVCacheTensors(
            slots, num_cpu_blocks, config.block_size, cfg.num_kv_heads, cfg.head_dim,
            self.kv_dtype, "cpu") if num_cpu_blocks > 0 else None
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self._ahead_ids: torch.Tensor | None = None  # the last launched step's sampled ids, on the device
        self.grammars = GrammarCompiler(self.model_dir, cfg.vocab_size, cfg.eos_token_ids)
        # the requests held: their states and rows (worker_svc/held_requests.py)
        self.held = HeldRequests(cfg.eos_token_ids, self.grammars, self._image_failure)

    def _graph_memory(self, sizes: list[int]) -> int:
        """What the decode graphs will hold (DecodeGraphs.profile, on a one-block cache)."""
        if not sizes:
            return 0
        cfg = self.model_config
        scratch = KVCacheTensors(self.kv_layout.group_size, 1, self.config.block_size, cfg.num_kv_heads,
                                 cfg.head_dim, self.kv_dtype, self.device)
        return DecodeGraphs.profile(self.model, self.inputs, (scratch.k_caches, scratch.v_caches),
                                    self.plan_attention, self.kv_layout.windows, sizes, self.device)

    @property
    def requests(self) -> dict[str, RequestState]:
        """The requests held, by id."""
        return self.held.states

    @property
    def num_requests(self) -> int:
        return len(self.held.states)

    def forget_all(self) -> int:
        """Drop every request (a new scheduler took over: it sends what it wants run again,
        from its tokens); how many were dropped."""
        return self.held.forget_all(self.inputs)

    @property
    def num_unfinished(self) -> int:
        """Requests still generating (finished ones wait here only to be forgotten)."""
        return self.held.num_unfinished

    def describe(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id, model=self.config.model_name,
            block_size=self.config.block_size, num_blocks=self.kv_cache.num_blocks,
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            num_cpu_blocks=self.cpu_cache.num_blocks if self.cpu_cache is not None else 0,
            device=str(self.device), kv_cache_group_windows=[w or 0 for w in self.kv_layout.windows],
            kv_cache_group_size=self.kv_layout.group_size,
            encoder_cache_items=self.vision.cache_items if self.vision is not None else 0,
            embeddings_fingerprint=(self.vision.published.fingerprint
                                    if self.vision is not None and self.vision.published is not None else ""),
        )

    def _swap_out(self, request: worker_pb2.StepRequest) -> None:
        if request.blocks_to_swap_out:
            if self.cpu_cache is None:
                raise StepConsistencyError(f"step {request.step_id}: swap-out without swap space")
            swap_blocks(self.kv_cache, self.cpu_cache,
                        [(p.src, p.dst) for p in request.blocks_to_swap_out])
        self.held.drop_tables(request.swapped_out_request_ids, self.inputs)

    def _copy_in(self, request: worker_pb2.StepRequest) -> None:
        if request.blocks_to_swap_in:
            if self.cpu_cache is None:
                raise StepConsistencyError(f"step {request.step_id}: swap-in without swap space")
            swap_blocks(self.cpu_cache, self.kv_cache,
                        [(p.src, p.dst) for p in request.blocks_to_swap_in])
        if request.blocks_to_copy:
            self.kv_cache.copy_blocks([(p.src, p.dst) for p in request.blocks_to_copy])

    def _image_failure(self, state: RequestState) -> str | None:
        """Why this worker cannot serve `state`'s images, or None."""
        if self.vision_config is None:
            return f"the model {self.config.model_name} takes no images"
        if self.vision is None:
            return "this worker reads no media store, so it serves text only"
        return self.vision.check(state)

    def step(self, request: worker_pb2.StepRequest) -> StepOutput:
        return self.finish(self.launch(request))

    def launch(self, request: worker_pb2.StepRequest) -> LaunchedStep:
        """Steps 0-4 up to the sampled ids, on the device (`finish` takes them to the host).
        One step may be launched while the one before is not finished, where
        `can_launch_ahead` says so: a token that step sampled is then read from the device."""
        start = time.perf_counter()
        if self.cpu_share is not None and (threads := self.cpu_share.threads()):
            torch.set_num_threads(threads)
        with torch.inference_mode():
            launched = self._launch(request)
        launched.launch_seconds = time.perf_counter() - start
        return launched

    def can_launch_ahead(self, request: worker_pb2.StepRequest) -> bool:
        """Whether `request` may launch before the step in flight finishes: nothing it does
        reads what that step's sampled tokens change on the host (a grammar's state, the
        penalties' counts, min_tokens), and nothing in it waits for the device (logprobs
        read on the host, images encoded, blocks swapped or copied)."""
        if (request.blocks_to_swap_out or request.blocks_to_swap_in or request.blocks_to_copy
                or request.swapped_out_request_ids):
            return False
        for new in request.new_requests:
            sampling = new.sampling
            if new.mm_inputs or sampling.HasField("grammar") or sampling.HasField("prompt_logprobs") \
                    or sampling.HasField("logprobs") or uses_edits(sampling):
                return False
        for request_id in request.num_scheduled_tokens:
            state = self.held.states.get(request_id)
            if state is not None and (state.grammar is not None or state.edits or state.logprobs is not None
                                      or state.num_computed_tokens < state.images_end
                                      or (state.prompt_logprobs is not None
                                          and state.num_computed_tokens < state.num_prompt_tokens - 1)):
                return False
        return True

    def _launch(self, request: worker_pb2.StepRequest) -> LaunchedStep:
        self._swap_out(request)
        self.held.update(request, self.inputs)
        self._copy_in(request)
        scheduled, failed = self.held.scheduled(request)
        result = worker_pb2.StepResult(step_id=request.step_id)
        events: dict[str, list[TokenEvent]] = {}
        embeddings, vision = None, None
        if self.vision is not None and any(s.num_computed_tokens < s.images_end for s, _ in scheduled):
            scheduled, embeddings, vision = self._embed_images(scheduled, failed)
            if vision is not None:  # for the scheduler's WorkerStats (the gateway's /metrics)
                result.images.CopyFrom(worker_pb2.ImageStepStats(
                    queries=vision.queries, cache_hits=vision.cache_hits, published_hits=vision.published_hits,
                    items_encoded=vision.items_encoded, seconds=vision.seconds))
        for state, message in failed:
            fail_request(state, message, result, events)
        if not scheduled:
            return LaunchedStep(request, result, events, vision, {})
        produced, sampled, ids, result.forward_seconds, result.sample_seconds = self._execute(scheduled, embeddings)
        return LaunchedStep(request, result, events, vision, produced, sampled, ids)

    def finish(self, launched: LaunchedStep) -> StepOutput:
        """Step 5 (worker_svc/step_output.py): the sampled ids on the host, appended, and
        the step's result and events. A request that the step before finished while this
        one was launched ahead of it was computed for nothing: it gets nothing here."""
        return finish_step(launched, self.max_model_len)

    def _embed_images(self, scheduled: list[tuple[RequestState, int]], failed: list[tuple[RequestState, str]]):
        """The embeddings of the images the scheduled chunks hold (worker_svc/vision_step.py).
        Requests an image of theirs failed move from `scheduled` to `failed`. Returns
        (what is left scheduled, embeddings by content hash, the step's VisionStepStats),
        the last two None when no chunk holds an image."""
        images = self.vision.prepare(scheduled)
        if not images.embeddings and not images.failed:
            return scheduled, None, None
        if images.failed:
            failed.extend(images.failed)
            out = {id(state) for state, _ in images.failed}
            scheduled = [(state, n) for state, n in scheduled if id(state) not in out]
        return scheduled, images.embeddings, images.stats

    def _execute(self, scheduled: list[tuple[RequestState, int]],
                 image_embeddings: dict[str, torch.Tensor] | None = None):
        """Forward the flat batch (with the images' embeddings by content hash over their
        soft tokens' rows), advance num_computed_tokens, sample, gather logprobs. Returns
        the logprobs the requests that asked got (by id(state)), the requests that sampled,
        their sampled ids, and the seconds of the forward and of the sampling."""
        prompt_rows, prompt_targets, prompt_ks, prompt_parts = (
            prompt_logprob_rows(scheduled) if self.held.prompt_logprobs else ((), (), (), ()))
        size = self._graph_size(scheduled) if self.graphs is not None and not prompt_rows else None
        batch = self.inputs.prepare(scheduled, self.plan_attention, self.kv_layout.windows, pad_to=size,
                                    ahead_ids=self._ahead_ids)
        forward_start = time.perf_counter()
        if size is not None:  # every request decodes and samples: the rows are the requests
            y, residual = self.graphs.replay(size)
            logits = self.model.logits(y[:len(scheduled)], residual[:len(scheduled)])
        else:
            indices = batch.logits_indices
            if prompt_rows:
                indices = torch.cat([indices, torch.tensor(prompt_rows, device=self.device)])
            inputs_embeds = None
            if batch.images:
                inputs_embeds = place_step_images(self.model.embed(batch.input_ids), batch.images,
                                                  image_embeddings or {})
            logits = self.model(batch.input_ids, batch.positions, batch.attn,
                                (self.kv_cache.k_caches, self.kv_cache.v_caches), indices,
                                inputs_embeds=inputs_embeds)
        forward_seconds = time.perf_counter() - forward_start
        for state, n in scheduled:
            state.num_computed_tokens += n
        reqs = batch.sampling_requests
        produced: dict[int, Produced] = {}
        if prompt_rows:
            logprobs = gather_logprobs(logits[len(reqs):], torch.tensor(prompt_targets, device=self.device),
                                       prompt_ks)
            start = 0
            for state, position, count in prompt_parts:
                out = produced.setdefault(id(state), Produced(state))
                out.prompt_logprobs, out.prompt_index = logprobs[start:start + count], position
                start += count
        sample_start = time.perf_counter()
        ids = None
        if reqs:
            ids = SampledIds(self._sample(logits[:len(reqs)], reqs, batch.sampling, produced))
            self._ahead_ids = ids.device
            for j, state in enumerate(reqs):
                state.ahead = j
        return produced, reqs, ids, forward_seconds, time.perf_counter() - sample_start

    def _graph_size(self, scheduled: list[tuple[RequestState, int]]) -> int | None:
        """The captured size a step replays: every request computes its last token (one, on
        the host or in flight) and samples, and there are at most the largest size of them;
        else None (eager)."""
        if all(n == 1 and len(state.token_ids) - 1 <= state.num_computed_tokens for state, n in scheduled):
            return self.graphs.size_for(len(scheduled))
        return None

    def _sample(self, logits: torch.Tensor, reqs: tuple[RequestState, ...], sampling: SamplingBatch,
                produced: dict[int, Produced]) -> torch.Tensor:
        """Sample on the device from the persistent batch's settings and seeds, with the
        per-step edits of the rows that need them; returns the ids, on the device (the
        logprobs asked for go into `produced`)."""
        if any(r.edits or r.grammar is not None for r in reqs):
            vocab_size = self.model_config.vocab_size
            allowed = self.grammars.allowed([r.grammar for r in reqs], vocab_size, self.device) \
                if any(r.grammar is not None for r in reqs) else None
            sampling = sampling.with_edits(reqs, vocab_size, self.model_config.eos_token_ids, self.device, allowed)
        token_ids = sample(logits, sampling, self.generator, self.backend.exponential_race)
        rows = [i for i, r in enumerate(reqs) if r.logprobs is not None]
        logprobs = gather_logprobs(logits[rows], token_ids[rows], [reqs[i].logprobs for i in rows]) if rows else []
        for i, lp in zip(rows, logprobs):
            produced.setdefault(id(reqs[i]), Produced(reqs[i])).logprobs = lp
        return token_ids
