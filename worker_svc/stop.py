"""The one finish rule, applied after every sampled token.

Works on either SamplingParams (the protobuf one on the wire, the msgspec one in Redis):
both carry max_tokens, stop_token_ids, ignore_eos and min_tokens.
"""

from collections.abc import Collection
from typing import Protocol, Sequence


class StopParams(Protocol):
    max_tokens: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    min_tokens: int


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
    if num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and new_token_id in eos_token_ids:
            return "stop"
        if new_token_id in params.stop_token_ids:
            return "stop"
    if 0 < params.max_tokens <= num_output_tokens or num_tokens >= max_model_len:
        return "length"
    return None
