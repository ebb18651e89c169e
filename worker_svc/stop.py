"""The one finish rule, applied after every sampled token.

Works on either SamplingParams (the protobuf one on the wire, the msgspec one in Redis):
both carry max_tokens, stop_token_ids, ignore_eos and min_tokens.
"""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol, Sequence


class StopParams(Protocol):
    max_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    min_tokens: int


@dataclass(frozen=True, slots=True)
class StopRule:
    """A request's finish rule, read once from its params (`of`) and applied after each of
    its sampled tokens (`reason`)."""

    stop_ids: frozenset[int]  # its stop_token_ids, and the model's EOS ids unless ignore_eos
    min_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, params: StopParams, eos_token_ids: Collection[int]) -> "StopRule":
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(eos_token_ids)
        return cls(frozenset(stops), params.min_tokens, params.max_tokens)

    def reason(self, num_output_tokens: int, new_token_id: int, num_tokens: int,
               max_model_len: int) -> str | None:
        """finish_reason's answer (below), with the params read already."""
        if num_output_tokens >= self.min_tokens and new_token_id in self.stop_ids:
            return "stop"
        if 0 < self.max_tokens <= num_output_tokens or num_tokens >= max_model_len:
            return "length"
        return None


def finish_reason(params: StopParams, num_output_tokens: int, new_token_id: int,
                  eos_token_ids: Collection[int], num_tokens: int,
                  max_model_len: int) -> str | None:
    """Why the request ends with `new_token_id`, or None if it goes on.

    num_output_tokens and num_tokens (prompt + outputs) both count the new token.
    - "stop": the new token is an EOS id (unless ignore_eos) or one of stop_token_ids,
      and at least min_tokens outputs exist (before that the sampler bans them; should one
      still come, it is an ordinary token). The stop token itself is part of the output.
    - "length": max_tokens outputs exist, or the sequence reached max_model_len (no room
      for another token's K/V). max_tokens <= 0 means no cap but max_model_len (proto3's
      unset value).
    "stop" wins over "length" when both hold.
    """
    return StopRule.of(params, eos_token_ids).reason(num_output_tokens, new_token_id, num_tokens, max_model_len)
