"""A step launched on the device and not finished yet (ModelRunner.launch returns it,
ModelRunner.finish completes it): what each request got from the step so far, and the
step's sampled ids, on the device and on their way to the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto import worker_pb2
from proto.messages import Logprobs, TokenEvent
from worker_svc.request_state import RequestState
from worker_svc.vision_step import VisionStepStats


class SampledIds:
    """A step's sampled ids: on the device, and on their way to the host (one non-blocking
    copy, waited for only when the host reads them)."""

    def __init__(self, ids: torch.Tensor):
        self.device = ids
        self._host, self._ready = ids, None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()

    def ready(self) -> bool:
        return self._ready is None or self._ready.query()

    def tolist(self) -> list[int]:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


@dataclass(slots=True)
class Produced:
    """What one request got from a step besides its sampled token (LaunchedStep.ids): the
    token's logprobs, and/or prompt logprobs. Only the requests that asked have one."""

    state: RequestState
    logprobs: Logprobs | None = None
    prompt_logprobs: list[Logprobs] | None = None
    prompt_index: int = 0  # prompt position of prompt_logprobs[0]


@dataclass(slots=True)
class LaunchedStep:
    """A step launched (ModelRunner.launch): its work queued on the device, its sampled ids
    on their way to the host; ModelRunner.finish appends them and makes the StepOutput."""

    request: worker_pb2.StepRequest
    result: worker_pb2.StepResult
    events: dict[str, list[TokenEvent]]
    vision: VisionStepStats | None
    produced: dict[int, Produced]  # id(state) -> what the request got besides its token
    sampled: tuple[RequestState, ...] = ()  # the requests `ids` are for, in order
    ids: SampledIds | None = None
    launch_seconds: float = 0.0

    def ready(self) -> bool:
        """Whether `finish` would not wait for the device."""
        return self.ids is None or self.ids.ready()
