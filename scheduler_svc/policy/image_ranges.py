"""The images of a request's prompt as the scheduler sees them: ranges of soft tokens.

An image (or a video frame, or a pan-and-scan crop of either) is a
`MultiModalInput(content_hash, offset, length, crop)` (proto/messages.py): prompt positions
`offset <= p < offset + length` hold its soft tokens, whose embeddings the worker replaces
by the image's. Everything here keys an image by its `embedding_key` (the content hash, and
a crop's box), never by the hash alone: a crop is not its image. In Gemma 3 they attend to each other
both ways, so the worker computes one image's K/V in one step, and the scheduler keeps
every request's `num_computed_tokens` (and so every chunk's start and end) out of an
image's inside -- `offset < p < offset + length`, `inside` below -- (the planner's rule,
scheduler_svc/policy/planner.py; checked by BatchScheduler.check_integrity).

Well-formed (`why_invalid`): each range non-empty and within the prompt, in prompt order,
no two overlapping. The scheduler refuses a request whose ranges are not.

Prefix caching: block i's extra keys (kvstore/block_hash.py) are `(embedding_key, offset)`
of every image whose range overlaps block i, in order (`block_extra_keys`); a block with no
image keeps `()`. So a text prefix shared by requests with different images still hits, a
repeated image behind the same prefix hits, and a different image behind the same
placeholder tokens never does (every later block chains on the key), nor does another crop
of the same image (pan-and-scan with other settings). The offset is in the
key because the placeholder tokens need not show where one image ends and the next starts.
A hit never ends inside an image (`hit_blocks`): the image is computed again whole.
"""

from collections.abc import Sequence

from kvstore.block_hash import span_block_keys
from proto import worker_pb2
from proto.messages import MultiModalInput

MMInputs = Sequence[MultiModalInput]


def images_end(mm_inputs: MMInputs) -> int:
    """The position after the last image (0 with none): no chunk starting there or later
    can reach an image."""
    return mm_inputs[-1].offset + mm_inputs[-1].length if mm_inputs else 0


def why_invalid(mm_inputs: MMInputs, num_prompt_tokens: int) -> str | None:
    """Why these ranges are not well-formed for a prompt of that length, or None."""
    end = 0
    for i, image in enumerate(mm_inputs):
        if image.length < 1 or image.offset < end or image.offset + image.length > num_prompt_tokens:
            return (f"image {i} (offset {image.offset}, length {image.length}) must be a non-empty "
                    f"range of the {num_prompt_tokens} prompt tokens after the image before it "
                    f"(ending at {end})")
        end = image.offset + image.length
    return None


def image_inside(mm_inputs: MMInputs, position: int) -> MultiModalInput | None:
    """The image with `position` strictly inside its range, or None."""
    for image in mm_inputs:
        if image.offset >= position:
            return None
        if position < image.offset + image.length:
            return image
    return None


def hit_blocks(mm_inputs: MMInputs, num_blocks: int, block_size: int) -> int:
    """How many of a prefix hit's first `num_blocks` blocks to take so the hit does not
    end inside an image: cut back to the last block boundary at or before the start of the
    image it would end in (again, for an earlier image the cut may then end in)."""
    end = num_blocks * block_size
    for image in reversed(mm_inputs):
        if image.offset + image.length <= end:
            break  # this image and every earlier one end before the hit does
        if image.offset < end:
            end = image.offset // block_size * block_size
    return end // block_size


def block_extra_keys(mm_inputs: MMInputs, block_size: int) -> dict[int, tuple]:
    """Block index -> the (embedding_key, offset) keys of the images overlapping it, in
    order; blocks without an image are absent (their keys are ())."""
    return span_block_keys(((m.offset, m.offset + m.length, (m.embedding_key, m.offset))
                            for m in mm_inputs), block_size)


def to_pb_mm_inputs(mm_inputs: MMInputs) -> list[worker_pb2.MultiModalInput]:
    """msgspec MultiModalInputs (Redis side) -> protobuf ones (NewRequestData.mm_inputs)."""
    return [worker_pb2.MultiModalInput(content_hash=m.content_hash, offset=m.offset, length=m.length,
                                       crop=None if m.crop is None else worker_pb2.CropBox(**m.crop._asdict()))
            for m in mm_inputs]
