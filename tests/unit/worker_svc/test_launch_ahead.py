"""ModelRunner.launch / finish with a step launched ahead: step k+1 launched before step k
finishes reads k's sampled tokens on the device (InputBatch.prepare's ahead_ids) and
samples what it would have sampled with k finished first: greedy, seeded draws, a stop
token met while the step after is in flight (that request computed once more for
nothing, and given nothing), and requests whose steps cannot launch ahead (a penalty, a
grammar). Driven by the real BatchScheduler with two steps in flight, on the CPU with the
persistent batch's device memory kept apart as on a GPU, eagerly and with decode steps laid
out in the graph buffers and replayed (KV cache groups for Gemma 3's sliding layers); under
the `gpu` marker on CUDA with the decode graphs captured."""

from __future__ import annotations

import time

import pytest
import torch

from proto.messages import Grammar, NewRequest, SamplingParams
from tests.support.runner_helpers import make_runner
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig
from worker_svc.cuda_graphs import capture_sizes
from worker_svc.input_batch import InputBatch

BLOCK_SIZE = 4


def requests(stop_token: int | None, *, penalty: bool = True, grammar: bool = True) -> list[NewRequest]:
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18], [19, 20, 21], [22, 23, 24, 25, 26, 27]]
    params = [SamplingParams(max_tokens=12, temperature=0.0),
              SamplingParams(max_tokens=10, temperature=1.0, seed=11),
              SamplingParams(max_tokens=11, temperature=0.8, top_p=0.9, top_k=40, seed=3),
              SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_token] if stop_token else [])]
    if penalty:
        params.append(SamplingParams(max_tokens=3, temperature=0.0, repetition_penalty=1.3))
    if grammar:
        params.append(SamplingParams(max_tokens=4, temperature=0.0, grammar=Grammar("regex", "[a-z]+")))
    return [NewRequest(f"r{i}", prompt, sampling, "out", time.time())
            for i, (prompt, sampling) in enumerate(zip(prompts, params))]


def generate(runner, reqs: list[NewRequest], launch_ahead: bool):
    """Every request to the end, a step planned ahead whenever the scheduler can, launched
    before the one in flight finishes where `launch_ahead` and the runner allow. Returns
    the outputs, how many steps launched ahead, and the ids of requests a step launched
    ahead computed after the step before finished them. Every output token is in one
    StepResult and one TokenEvent, and nothing more is."""
    scheduler = BatchScheduler.for_worker(SchedulerConfig(max_num_batched_tokens=16), runner.describe())
    for req in reqs:
        scheduler.add_request(req)
    outputs, ahead, for_nothing = {}, 0, set()
    in_results, in_events = {}, {}

    def finish(step, launched):
        output = runner.finish(launched)
        for token in output.result.sampled:
            in_results.setdefault(token.request_id, []).append(token.token_id)
        for event in output.events.get("out", []):
            in_events.setdefault(event.request_id, []).extend(event.token_ids)
        for req in scheduler.update(step, output.result):
            outputs[req.request_id] = req.output_token_ids

    step = scheduler.schedule()
    launched = runner.launch(step)
    while step is not None:
        nxt = scheduler.schedule() if scheduler.can_schedule_ahead() else None
        if nxt is not None and launch_ahead and runner.can_launch_ahead(nxt):
            nxt_launched = launch_without_waiting(runner, nxt)
            ahead += 1
            finish(step, launched)
            for_nothing |= set(nxt.num_scheduled_tokens) & set(outputs)
        else:
            finish(step, launched)
            if nxt is None and scheduler.has_work():
                nxt = scheduler.schedule()
            nxt_launched = runner.launch(nxt) if nxt is not None else None
        step, launched = nxt, nxt_launched
    assert in_results == outputs and in_events == outputs
    return outputs, ahead, for_nothing


def launch_without_waiting(runner, step):
    """runner.launch(step); on CUDA, any wait for the device in it is an error (the host
    must stay ahead of the device)."""
    if runner.device.type != "cuda":
        return runner.launch(step)
    torch.cuda.set_sync_debug_mode("error")
    try:
        return runner.launch(step)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def apart(runner):
    """The runner's persistent batch with its device memory apart from the host's."""
    runner.inputs = InputBatch(runner.kv_layout.num_groups, BLOCK_SIZE, runner.inputs.width,
                               runner.model_config.vocab_size, runner.device, separate_device_memory=True)
    return runner


def replaying(runner, largest: int = 4):
    """The runner's decode steps laid out in the graph buffers and replayed as on a GPU
    (tests/unit/worker_svc/test_cuda_graphs.py's CpuReplay), its device memory apart from the host's."""
    from tests.unit.worker_svc.test_cuda_graphs import CpuReplay

    runner.inputs = InputBatch(runner.kv_layout.num_groups, BLOCK_SIZE, runner.inputs.width,
                               runner.model_config.vocab_size, runner.device, graph_capacity=largest,
                               separate_device_memory=True)
    runner.graphs = CpuReplay(runner.model, runner.inputs, (runner.kv_cache.k_caches, runner.kv_cache.v_caches),
                              runner.plan_attention, runner.kv_layout.windows, capture_sizes(largest))
    runner.graphs.capture(runner.device)
    return runner


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_launched_ahead_into_the_graph_buffers(family_model_dir, arch):
    """Pure-decode steps launched ahead take their tokens in flight in the graph buffers
    (padded to a captured size; sliding layers in a KV cache group of their own for
    gemma3), and sample what finishing first samples."""
    reqs = requests(None, penalty=False, grammar=False)
    finished_first, _, _ = generate(replaying(make_runner(family_model_dir(arch), BLOCK_SIZE, 256)), reqs, False)
    runner = replaying(make_runner(family_model_dir(arch), BLOCK_SIZE, 256))
    outputs, ahead, _ = generate(runner, reqs, True)
    assert outputs == finished_first and ahead >= 6 and runner.graphs.replays >= 6


def test_a_step_launched_ahead_samples_what_it_samples_after_the_one_before(tiny_model_dir):
    reference, _, _ = generate(apart(make_runner(tiny_model_dir, BLOCK_SIZE, 128)), requests(None), False)
    stop_token = reference["r3"][4]  # r3 stops at its fifth token, the step after it in flight
    assert stop_token not in reference["r3"][:4]
    finished_first, _, _ = generate(apart(make_runner(tiny_model_dir, BLOCK_SIZE, 128)), requests(stop_token), False)
    assert len(finished_first["r3"]) == 5 and len(finished_first) == 6
    runner = apart(make_runner(tiny_model_dir, BLOCK_SIZE, 128))
    outputs, ahead, for_nothing = generate(runner, requests(stop_token), True)
    assert outputs == finished_first
    assert ahead >= 6 and "r3" in for_nothing
    assert not any(state.finish_reason is None for state in runner.requests.values())


EXCLUDED = {  # what a request may ask that keeps a step holding it from launching ahead
    "repetition penalty": dict(repetition_penalty=1.3),
    "frequency penalty": dict(frequency_penalty=0.5),
    "presence penalty": dict(presence_penalty=0.5),
    "min_tokens": dict(min_tokens=3),
    "logit_bias": dict(logit_bias={7: 2.0}),
    "grammar": dict(grammar=Grammar("regex", "[a-z]+")),
    "logprobs": dict(logprobs=2),
    "prompt logprobs": dict(prompt_logprobs=1),
}


@pytest.mark.parametrize("asks", EXCLUDED.values(), ids=EXCLUDED.keys())
def test_a_request_whose_step_reads_the_host_keeps_it_from_launching_ahead(tiny_model_dir, asks):
    runner = make_runner(tiny_model_dir, BLOCK_SIZE, 128)
    scheduler = BatchScheduler.for_worker(SchedulerConfig(max_num_batched_tokens=16), runner.describe())
    scheduler.add_request(NewRequest("plain", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0),
                                     "out", time.time()))
    scheduler.add_request(NewRequest("asks", list(range(8, 28)), SamplingParams(max_tokens=8, temperature=0.0,
                                                                                **asks), "out", time.time()))
    first = scheduler.schedule()
    assert not runner.can_launch_ahead(first)  # it comes new in this step
    scheduler.update(first, runner.step(first).result)
    step = scheduler.schedule()
    assert dict(step.num_scheduled_tokens) == {"plain": 1, "asks": 7}  # the rest of its prompt
    assert not runner.can_launch_ahead(step)  # it goes on in this one
    del step.num_scheduled_tokens["asks"]
    assert runner.can_launch_ahead(step)


def test_images_and_block_moves_keep_a_step_from_launching_ahead(tiny_model_dir):
    runner = make_runner(tiny_model_dir, BLOCK_SIZE, 128)
    scheduler = BatchScheduler.for_worker(SchedulerConfig(max_num_batched_tokens=64), runner.describe())
    scheduler.add_request(NewRequest("plain", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0),
                                     "out", time.time()))
    first = scheduler.schedule()
    scheduler.update(first, runner.step(first).result)
    step = scheduler.schedule()
    assert runner.can_launch_ahead(step)
    for move in ("blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy"):
        moving = type(step)()
        moving.CopyFrom(step)
        getattr(moving, move).add(src=1, dst=2)
        assert not runner.can_launch_ahead(moving), move
    swapped = type(step)()
    swapped.CopyFrom(step)
    swapped.swapped_out_request_ids.append("plain")
    assert not runner.can_launch_ahead(swapped)
    with_image = type(step)()
    with_image.CopyFrom(step)
    new = with_image.new_requests.add(request_id="image", token_ids=[5, 6, 7, 8], num_prompt_tokens=4,
                                      block_ids=[3])
    new.mm_inputs.add(content_hash="0" * 64, offset=1, length=2)
    assert not runner.can_launch_ahead(with_image)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_on_cuda_with_decode_graphs(family_model_dir, arch):
    """fp32 on CUDA, the graphs replaying: launched ahead equals finished first, and a
    launch ahead never waits for the device."""
    def runner():
        return make_runner(family_model_dir(arch), BLOCK_SIZE, 256, device="cuda", dtype="float32",
                           attention_backend="triton", max_cudagraph_capture_size=16)
    reqs = requests(None, penalty=False, grammar=False)
    finished_first, _, _ = generate(runner(), reqs, False)
    ahead_runner = runner()
    outputs, ahead, _ = generate(ahead_runner, reqs, True)
    assert ahead_runner.graphs is not None and ahead_runner.graphs.replays > 0
    assert ahead > 0 and outputs == finished_first
