"""The prompt of a chat request with images or video, for a vision checkpoint (Gemma 3): the
token ids Gemma3Processor would make from the same messages, and where each image's soft
tokens sit in them (`NewRequest.mm_inputs`). Text-only requests never come here.

    parts = media_parts(body.messages)         # every image_url / video_url / file part, in order
    prompts.check(body, parts)                 # refusals that need no fetching (400)
    prompt = await prompts.build(body, parts, tools)
    # → MediaPrompt(token_ids, mm_inputs=(MultiModalInput(content_hash, offset, length), ...))

`build`, step by step:
1. The MediaLoader fetches, checks and stores every part (gateway/media/loader.py; each bad
   part a 400 naming it); a video becomes its sampled frames. A part without data is what
   was sent before under its uuid (gateway/media/uuids.py): the same hashes, the same prompt.
2. The messages go to the checkpoint's chat template with each image as `{"type": "image"}`
   and each video as, per kept frame, a text part `Frame at MM:SS.ss:` (its timestamp from
   the video's first frame: minutes, then seconds to the hundredth, e.g. "Frame at
   00:01.50:") followed by `{"type": "image"}`. So a video and its frames sent as images,
   each after that same text, make the same prompt.
3. Each `<start_of_image>` of the rendered text becomes `ImageTokens.expanded` (Gemma3Processor's
   rule, gateway/image_tokens.py); the text is tokenized as the text path tokenizes it.
4. Each run of soft tokens is one image, in prompt order: its offset and length, with the
   content hash of the image (or frame) it stands for. The counts are checked: the number
   of placeholders rendered, of runs, and of tokens per run must match the images, so text
   that spells out the model's image tokens cannot make a soft token without an image.
Only hashes and ranges go on; the pixels stay in Redis (gateway/media/store.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.content_parts import FilePart, MediaContentPart
from gateway.errors import OpenAIError, invalid
from gateway.image_tokens import ImageTokens
from gateway.media.loader import LoadedMedia, MediaLoader, MediaPart
from gateway.media.options import VideoSampling
from gateway.media.uuids import SHARED_SCOPE
from gateway.chat_message import ChatMessage
from gateway.protocol import ChatCompletionRequest
from gateway.tokenizer import PromptTokenizer
from proto.messages import MultiModalInput


@dataclass(frozen=True)
class MediaPrompt:
    token_ids: list[int]
    mm_inputs: tuple[MultiModalInput, ...]  # in prompt order, one per image or video frame


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
                    tools: list[dict[str, Any]] | None, scope: str = SHARED_SCOPE) -> MediaPrompt:
        """The prompt of `body`, whose media are `parts` (from `media_parts`); `check` first.
        `scope`: whose media uuids the parts may name (gateway/media/uuids.py)."""
        assert self.image_tokens is not None and self.loader is not None, "check() refuses this server"
        loaded = await self.loader.load(parts, self._sampling(body.media_io_kwargs), scope)
        messages, hashes = _template_messages(body.messages, loaded)
        token_ids, runs = await asyncio.to_thread(self._tokenize, body, messages, tools, len(hashes))
        return MediaPrompt(token_ids, tuple(MultiModalInput(content_hash, offset, length)
                                            for content_hash, (offset, length) in zip(hashes, runs)))

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
                  tools: list[dict[str, Any]] | None, num_images: int) -> tuple[list[int], list[tuple[int, int]]]:
        """Render, expand, tokenize (in a thread: CPU-bound); the (offset, length) of each
        image's soft tokens."""
        tokens = self.image_tokens
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
        token_ids = self.tokenizer.encode_text(text.replace(tokens.boi, tokens.expanded),
                                               bool(body.add_special_tokens))
        runs = list(_runs(token_ids, tokens.soft_id))
        if len(runs) != num_images or any(length != tokens.per_image for _, length in runs):
            raise _spelled_out(f"the prompt holds {sum(n for _, n in runs)} soft tokens ('{tokens.soft}') "
                               f"for {num_images} images of {tokens.per_image}")
        return token_ids, runs


def _template_messages(messages: Sequence[ChatMessage],
                       loaded: Sequence[LoadedMedia]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as the chat template takes them, and the content hash of each image the
    template will place, in order (a video: one per kept frame)."""
    media: Iterator[LoadedMedia] = iter(loaded)
    out: list[dict[str, Any]] = []
    hashes: list[str] = []
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
                hashes.append(item.content_hash)
            else:
                for frame in item.frames:
                    parts += [{"type": "text", "text": frame_label(frame.timestamp_s)}, {"type": "image"}]
                    hashes.append(frame.content_hash)
        out.append(message.template_dict(parts))
    return out, hashes


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
