"""The requests a worker holds (steps 1-2 of worker_svc/model_runner.py, on the host):
each one's RequestState by id, with its row in the persistent batch (worker_svc/input_batch.py:
the runner's, handed to each call that adds, changes or frees rows), and which of them ask
for prompt logprobs. A StepRequest's changes are applied here -- the
finished requests forgotten, the new ones added (a request sent again replaces its old
self), the cached ones' block tables extended or replaced, the swapped-out ones' tables
dropped -- and its scheduled requests looked up. Where the scheduler's view of a request
disagrees with the worker's, a StepConsistencyError.
"""

from collections.abc import Callable, Collection, Iterable

from proto import worker_pb2
from worker_svc.grammar import GrammarCompiler
from worker_svc.input_batch import InputBatch
from worker_svc.request_state import RequestState, split_groups


class StepConsistencyError(RuntimeError):
    """The scheduler's view of a request disagrees with the worker's."""


class HeldRequests:
    """The held requests' states; their rows are in the persistent batch the runner holds,
    `inputs` in each call that changes them. `grammars` compiles a new request's grammar;
    `image_failure(state)`: why this worker cannot serve the images of a new request that
    has some, or None."""

    def __init__(self, eos_token_ids: Collection[int], grammars: GrammarCompiler,
                 image_failure: Callable[[RequestState], str | None]):
        self.eos_token_ids, self.grammars, self.image_failure = eos_token_ids, grammars, image_failure
        self.states: dict[str, RequestState] = {}
        self.prompt_logprobs: set[str] = set()  # the requests held that ask for prompt logprobs

    @property
    def num_unfinished(self) -> int:
        """Requests still generating (finished ones wait here only to be forgotten)."""
        return sum(1 for state in self.states.values() if state.finish_reason is None)

    def forget_all(self, inputs: InputBatch) -> int:
        """Drop every request, and its row; how many were dropped."""
        dropped = len(self.states)
        self.states.clear()
        self.prompt_logprobs.clear()
        inputs.clear()
        return dropped

    def drop_tables(self, request_ids: Iterable[str], inputs: InputBatch) -> None:
        """Swapped out: their rows hold no block table until a replace_block_ids brings one
        back (their state stays: they resume where they stopped)."""
        for request_id in request_ids:
            state = self.states.get(request_id)
            if state is not None:  # not scheduled until a replace_block_ids brings it back
                inputs.drop_blocks(state.row)

    def update(self, request: worker_pb2.StepRequest, inputs: InputBatch) -> None:
        """The step's finished requests forgotten, its new ones added, its cached ones'
        block ids applied (their num_computed_tokens checked against ours), their rows in
        `inputs` with them."""
        groups = inputs.num_groups
        for request_id in request.finished_request_ids:
            self.forget(request_id, inputs)
        for new in request.new_requests:
            self.forget(new.request_id, inputs)  # sent again: its old row goes
            state = RequestState(new, eos_token_ids=self.eos_token_ids)
            state.row = inputs.add(new.sampling, split_groups(new.block_ids, groups))
            self.states[new.request_id] = state  # held once it has its row
            if state.prompt_logprobs is not None:
                self.prompt_logprobs.add(new.request_id)
            if state.image_ranges:
                state.failure = self.image_failure(state)
            if new.sampling.HasField("grammar"):  # replays any outputs (a resumed request)
                state.grammar = self.grammars.matcher(new.sampling.grammar.kind, new.sampling.grammar.spec,
                                                      state.token_ids[state.num_prompt_tokens:])
        for cached in request.cached_requests:
            state = self.states.get(cached.request_id)
            if state is None:
                raise StepConsistencyError(
                    f"step {request.step_id}: cached request {cached.request_id!r} is unknown "
                    f"to this worker (never added, or already forgotten)")
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise StepConsistencyError(
                    f"step {request.step_id}: request {cached.request_id!r} has "
                    f"num_computed_tokens={state.num_computed_tokens} on the worker, "
                    f"the scheduler says {cached.num_computed_tokens}")
            if cached.new_block_ids or cached.replace_block_ids:
                inputs.set_blocks(state.row, split_groups(cached.new_block_ids, groups),
                                  cached.replace_block_ids)

    def forget(self, request_id: str, inputs: InputBatch) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            inputs.remove(state.row)
            self.prompt_logprobs.discard(request_id)

    def scheduled(self, request: worker_pb2.StepRequest) -> tuple[list[tuple[RequestState, int]],
                                                                   list[tuple[RequestState, str]]]:
        """The step's scheduled requests that still generate: (state, tokens to compute) for
        those that can run, (state, why not) for those that fail in this step."""
        scheduled = []
        failed: list[tuple[RequestState, str]] = []
        for request_id, n in request.num_scheduled_tokens.items():
            state = self.states.get(request_id)
            if state is None:
                raise StepConsistencyError(
                    f"step {request.step_id}: scheduled request {request_id!r} is unknown")
            if state.finish_reason is None:
                if state.failure is None:
                    scheduled.append((state, n))
                else:
                    failed.append((state, state.failure))
        return scheduled, failed
