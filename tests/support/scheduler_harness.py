"""The scheduler test harness: one BatchScheduler and its fake worker (tests/support/fake_worker.py)
driven step by step, with check_integrity() after every schedule() and update(); used by the
scheduler policy tests (test_scheduler.py, test_swap.py, test_fork.py,
test_prefix_cache_scheduler.py, test_scheduling_ahead.py, ...)."""

from collections import deque

from tests.support.fake_worker import FakeWorker
from proto import worker_pb2
from proto.messages import NewRequest, SamplingParams
from scheduler_svc.policy.batching import BatchScheduler
from scheduler_svc.policy.config import SchedulerConfig


def make_request(request_id: str, prompt_len: int, max_tokens: int, arrival: float,
                 priority: int = 0, **sampling) -> NewRequest:
    prompt = [(7 * i + len(request_id) + ord(request_id[0])) % 97 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **sampling)
    return NewRequest(request_id, prompt, params, "out:gw", arrival, priority)


class Harness:
    """One scheduler and its fake worker, driven step by step. `pipelined`: as the
    scheduler service drives it, a step planned ahead whenever can_schedule_ahead(); the
    fake runs every step as soon as it is planned, before the scheduler sees the result of
    the one before (the most a real worker can be ahead)."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
                 vocab_size: int = 1000, eos_token_id: int | None = None,
                 num_cpu_blocks: int = 0, pipelined: bool = False,
                 group_windows: tuple[int | None, ...] = (None,), encoder_cache_items: int = 0,
                 **config) -> None:
        self.config = SchedulerConfig(**config)
        self.sched = BatchScheduler(self.config, num_blocks, block_size, max_model_len,
                                    num_cpu_blocks=num_cpu_blocks, group_windows=group_windows,
                                    encoder_cache_items=encoder_cache_items)
        self.worker = FakeWorker(num_blocks, block_size, self.config.max_num_batched_tokens,
                                 vocab_size, eos_token_id, num_cpu_blocks=num_cpu_blocks,
                                 group_windows=group_windows)
        self.finished: dict[str, object] = {}
        self.steps: list[worker_pb2.StepRequest] = []
        self.pipelined = pipelined
        self.in_flight: deque[tuple[worker_pb2.StepRequest, worker_pb2.StepResult]] = deque()
        self.num_ahead = 0  # steps planned ahead

    def add(self, *requests: NewRequest) -> None:
        for req in requests:
            assert self.sched.add_request(req) is None
        self.sched.check_integrity()

    def _send(self) -> worker_pb2.StepRequest | None:
        step = self.sched.schedule()
        self.sched.check_integrity()
        if step is not None:
            self.steps.append(step)
            self.in_flight.append((step, self.worker.step(step)))
        return step

    def step(self) -> worker_pb2.StepRequest | None:
        """Update one step (planning it first if none is in flight; pipelined, planning
        the next one ahead first when the scheduler allows); the step updated, or None."""
        if not self.in_flight and self._send() is None:
            return None
        if self.pipelined and self.sched.can_schedule_ahead():
            ahead = self._send()
            if ahead is not None:
                assert ahead.after_step_id == self.in_flight[0][0].step_id
                self.num_ahead += 1
        step, result = self.in_flight.popleft()
        for req in self.sched.update(step, result):
            self.finished[req.request_id] = req
        self.sched.check_integrity()
        return step

    def run(self, max_steps: int = 2000) -> None:
        while self.sched.has_work() or self.in_flight:
            assert self.step() is not None, "work left but nothing scheduled"
            assert len(self.steps) < max_steps, "no progress"
        self.assert_done()

    def assert_done(self) -> None:
        while self.in_flight:  # steps planned ahead for requests finished meanwhile
            self.step()
        assert not self.sched.has_work()
        assert self.sched.kv.num_free_blocks == self.sched.kv.num_blocks
        assert self.sched.kv.cpu_pool.num_free_blocks == self.sched.kv.num_cpu_blocks
        self.sched.check_integrity()

    def outputs(self) -> dict[str, list[int]]:
        return {rid: req.output_token_ids for rid, req in self.finished.items()}


def reference_outputs(*requests: NewRequest, group_windows: tuple[int | None, ...] = (None,)
                      ) -> dict[str, list[int]]:
    """Outputs with room for everything: no chunking, no preemption, no prefix caching,
    no step planned ahead."""
    h = Harness(num_blocks=1024 * len(group_windows), max_model_len=4096, max_num_batched_tokens=100_000,
                enable_prefix_caching=False, group_windows=group_windows)
    h.add(*requests)
    h.run()
    return h.outputs()


def scheduled(step: worker_pb2.StepRequest) -> dict[str, int]:
    return dict(step.num_scheduled_tokens)
