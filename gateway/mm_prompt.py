"""The prompt of a chat request with images or video, for a vision checkpoint (Gemma 3): the
token ids Gemma3Processor would make from the same messages, and where each image's soft
tokens sit in them (`NewRequest.mm_inputs`). Text-only requests never come here.

    parts = media_parts(body.messages)         # every image_url / video_url / file part, in order
    prompts.check(body, parts)                 # refusals that need no fetching (400)
    prompt = await prompts.build(body, parts, tools)
    # → MediaPrompt(token_ids, mm_inputs=(MultiModalInput(content_hash, offset, length, crop), ...))

`build`, step by step:
1. The MediaLoader fetches, checks and stores every part (gateway/media/loader.py; each bad
   part a 400 naming it); a video becomes its sampled frames. A part without data is what
   was sent before under its uuid (gateway/media/uuids.py): the same hashes, the same prompt.
2. The messages go to the checkpoint's chat template with each image as `{"type": "image"}`
   and each video as, per kept frame, a text part `Frame at MM:SS.ss:` (its timestamp from
   the video's first frame: minutes, then seconds to the hundredth, e.g. "Frame at
   00:01.50:") followed by `{"type": "image"}`. So a video and its frames sent as images,
   each after that same text, make the same prompt.
3. Pan-and-scan (proto/pan_and_scan.py), when the checkpoint's image processor or the
   request's `mm_processor_kwargs` turns it on (the request's over the checkpoint's): each
   image's crop boxes, from its width and height alone (the stored file's header, a
   frame's size). A video's frames are images here like any other, cropped the same way
   (transformers has no Gemma 3 video processor; frames sent as images get the crops too).
4. Each `<start_of_image>` of the rendered text becomes `ImageTokens.expanded`, or for an
   image with k crops `ImageTokens.expanded_with_crops(k)` (Gemma3Processor's rules,
   gateway/image_tokens.py); the text is tokenized as the text path tokenizes it. Before
   that, a prompt whose soft tokens alone exceed the context (pan-and-scan can ask for
   many crops) is refused.
5. Each run of soft tokens is one piece, in prompt order: its offset and length, with the
   content hash of the image (or frame) it stands for and, for a crop, its box (the image
   whole first, then its crops). The counts are checked: the number of placeholders
   rendered, of runs, and of tokens per run must match the pieces, so text that spells out
   the model's image tokens cannot make a soft token without an image.
Only hashes, boxes and ranges go on; the pixels stay in Redis (gateway/media/store.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.content_parts import FilePart, MediaContentPart
from gateway.errors import OpenAIError, invalid
from gateway.image_tokens import ImageTokens
from gateway.media.loaded import LoadedFrame, LoadedImage
from gateway.media.loader import LoadedMedia, MediaLoader, MediaPart
from gateway.media.options import VideoSampling
from gateway.media.uuids import SHARED_SCOPE
from gateway.chat_message import ChatMessage
from gateway.protocol import ChatCompletionRequest
from gateway.tokenizer import PromptTokenizer
from proto.messages import MultiModalInput
from proto.pan_and_scan import PanAndScan


@dataclass(frozen=True)
class MediaPrompt:
    token_ids: list[int]
    mm_inputs: tuple[MultiModalInput, ...]  # in prompt order, one per image or video frame (and crop)


def media_parts(messages: Sequence[ChatMessage]) -> list[MediaPart]:
    """Every image and video part of the messages, in prompt order, named for errors (a part
    without data by its uuid, an uploaded file by its file_id)."""
    return [MediaPart(part.kind, part.url, f"messages[{i}].content[{j}]." + _where(part), part.uuid,
                      part.file_id if isinstance(part, FilePart) else None)
            for i, message in enumerate(messages) for j, part in message.media_parts]


def _where(part: MediaContentPart) -> str:
    if isinstance(part, FilePart):
        return "file.file_id"
    return f"{part.type}.url" if part.url is not None else "uuid"


def frame_label(seconds: float) -> str:
    """The text before a video frame's image: "Frame at MM:SS.ss:" (time from the first frame)."""
    hundredths = round(seconds * 100)
    minutes, rest = divmod(hundredths, 6000)
    return f"Frame at {minutes:02d}:{rest // 100:02d}.{rest % 100:02d}:"


class MediaPrompts:
    """Builds the prompts of requests with media for one gateway. `image_tokens` None: a text
    checkpoint (media refused); `loader` None: a gateway without Redis to store media in (the
    in-process engine), which refuses them too."""

    def __init__(self, model_name: str, tokenizer: PromptTokenizer, image_tokens: ImageTokens | None,
                 loader: MediaLoader | None):
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.image_tokens = image_tokens
        self.loader = loader

    def check(self, body: ChatCompletionRequest, parts: Sequence[MediaPart]) -> None:
        """400 for media this server cannot take at all, before anything is fetched or queued."""
        if not parts:
            return
        what = "images" if parts[0].kind == "image" else "video"
        where = next(f"messages[{i}].content" for i, m in enumerate(body.messages) if m.has_media)
        if self.image_tokens is None:
            raise invalid(f"The model '{self.model_name}' does not accept {what}: it is a text-only model.",
                          param=where, code="model_not_multimodal")
        if self.loader is None:
            raise invalid(f"This server (the in-process engine, `pagedserve engine`) does not take {what}: "
                          "images and video are served by the stack (`pagedserve up`), whose gateway "
                          "stores them in Redis for the workers.", param=where, code="media_not_supported")
        self.loader.check_limits(parts)
        if body.truncate_prompt_tokens is not None:
            raise invalid("'truncate_prompt_tokens' cannot be used with images or video: it would cut "
                          "through an image's tokens.", param="truncate_prompt_tokens",
                          code="unsupported_parameter")

    def check_text_prompt(self, token_ids: list[int], param: str) -> None:
        """400 for a prompt without media that holds image soft tokens (typed as text, or
        sent as token ids): a worker would find no image to put behind them."""
        if self.image_tokens is not None and self.image_tokens.soft_id in token_ids:
            raise invalid(f"'{param}' holds the model's image soft token ('{self.image_tokens.soft}'), "
                          "which only image and video parts may put in a prompt.", param=param,
                          code="invalid_image_tokens")

    async def build(self, body: ChatCompletionRequest, parts: Sequence[MediaPart],
                    tools: list[dict[str, Any]] | None, scope: str = SHARED_SCOPE,
                    max_prompt_tokens: int | None = None) -> MediaPrompt:
        """The prompt of `body`, whose media are `parts` (from `media_parts`); `check` first.
        `scope`: whose media uuids the parts may name (gateway/media/uuids.py);
        `max_prompt_tokens`: the context, which the images' soft tokens alone may not pass."""
        assert self.image_tokens is not None and self.loader is not None, "check() refuses this server"
        settings = self._pan_and_scan(body)
        loaded = await self.loader.load(parts, self._sampling(body.media_io_kwargs), scope)
        messages, images = _template_messages(body.messages, loaded)
        counts = [settings.count(image.height, image.width) for image in images]  # no box made yet
        soft = (len(images) + sum(counts)) * self.image_tokens.per_image
        if max_prompt_tokens is not None and soft > max_prompt_tokens:
            raise invalid(f"This model's maximum context length is {max_prompt_tokens} tokens. However, the "
                          f"{len(images)} images take {soft} tokens ({sum(counts)} of them "
                          f"pan-and-scan crops, {self.image_tokens.per_image} tokens each). Please send fewer "
                          "or smaller images, or fewer crops (mm_processor_kwargs).", param="messages",
                          code="context_length_exceeded")
        crops = [settings.boxes(image.height, image.width) for image in images]
        token_ids, runs = await asyncio.to_thread(self._tokenize, body, messages, tools, [len(c) for c in crops])
        pieces = [(image.content_hash, crop) for image, boxes in zip(images, crops) for crop in (None, *boxes)]
        return MediaPrompt(token_ids, tuple(MultiModalInput(content_hash, offset, length, crop)
                                            for (content_hash, crop), (offset, length) in zip(pieces, runs)))

    def _pan_and_scan(self, body: ChatCompletionRequest) -> PanAndScan:
        """This request's pan-and-scan: its mm_processor_kwargs over the checkpoint's settings."""
        try:
            return self.image_tokens.pan_and_scan.overridden(body.mm_processor_kwargs)
        except ValueError as exc:  # the protocol checked them already; a 400 all the same
            raise invalid(str(exc), param="mm_processor_kwargs", code="invalid_value") from None

    def _sampling(self, request: dict[str, Any] | None) -> VideoSampling | None:
        """This request's video sampling: its media_io_kwargs (checked by the protocol) over
        the server's; None: the server's."""
        video = (request or {}).get("video")
        if not video:
            return None
        server = self.loader.settings.sampling
        return VideoSampling(num_frames=video.get("num_frames", server.num_frames),
                             fps=float(video.get("fps", server.fps)))

    def _tokenize(self, body: ChatCompletionRequest, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, num_crops: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Render, expand, tokenize (in a thread: CPU-bound); the (offset, length) of each
        piece's soft tokens (`num_crops`: each image's pan-and-scan crops, in order)."""
        tokens = self.image_tokens
        num_images = len(num_crops)
        text = self.tokenizer.render_chat(
            messages, tools=tools, add_generation_prompt=bool(body.add_generation_prompt),
            continue_final_message=bool(body.continue_final_message),
            template_kwargs=body.chat_template_kwargs or {})
        placed = text.count(tokens.boi)
        if placed < num_images:  # a --chat-template that leaves {"type": "image"} parts out
            raise invalid(f"The chat template placed {placed} of the {num_images} images in the prompt "
                          f"('{tokens.boi}'); it must write one for each image part.", param="messages",
                          code="chat_template_dropped_images")
        if placed > num_images:
            raise _spelled_out(f"the rendered prompt has {placed} image placeholders ('{tokens.boi}') "
                               f"for {num_images} images")
        between = text.split(tokens.boi)  # num_images + 1 texts around the placeholders
        expanded = between[0] + "".join(tokens.expanded_with_crops(k) + after
                                        for k, after in zip(num_crops, between[1:]))
        token_ids = self.tokenizer.encode_text(expanded, bool(body.add_special_tokens))
        runs = list(_runs(token_ids, tokens.soft_id))
        num_pieces = num_images + sum(num_crops)
        if len(runs) != num_pieces or any(length != tokens.per_image for _, length in runs):
            crops = f" and {sum(num_crops)} crops" if any(num_crops) else ""
            raise _spelled_out(f"the prompt holds {sum(n for _, n in runs)} soft tokens ('{tokens.soft}') "
                               f"for {num_images} images{crops} of {tokens.per_image}")
        return token_ids, runs


def _template_messages(messages: Sequence[ChatMessage], loaded: Sequence[LoadedMedia]
                       ) -> tuple[list[dict[str, Any]], list[LoadedImage | LoadedFrame]]:
    """The messages as the chat template takes them, and each image the template will place
    (its content hash and size), in order (a video: one per kept frame)."""
    media: Iterator[LoadedMedia] = iter(loaded)
    out: list[dict[str, Any]] = []
    images: list[LoadedImage | LoadedFrame] = []
    for message in messages:
        if not message.has_media:
            out.append(message.template_dict())
            continue
        parts: list[dict[str, Any]] = []
        for part in message.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            item = next(media)
            if item.kind == "image":
                parts.append({"type": "image"})
                images.append(item)
            else:
                for frame in item.frames:
                    parts += [{"type": "text", "text": frame_label(frame.timestamp_s)}, {"type": "image"}]
                    images.append(frame)
        out.append(message.template_dict(parts))
    return out, images


def _runs(token_ids: list[int], token_id: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each maximal run of `token_id` (list.index: the scan runs in C)."""
    start = 0
    while True:
        try:
            start = token_ids.index(token_id, start)
        except ValueError:
            return
        end = start + 1
        while end < len(token_ids) and token_ids[end] == token_id:
            end += 1
        yield start, end - start
        start = end


def _spelled_out(why: str) -> OpenAIError:
    return invalid(f"The messages' text contains the model's image tokens ({why}); only image and "
                   "video parts may put them in the prompt.", param="messages", code="invalid_image_tokens")
