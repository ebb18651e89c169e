"""The parts of a chat message's `content`, as OpenAI's (and vLLM's) chat API defines them:

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "...", "detail": "auto" | "low" | "high"}}
    {"type": "video_url", "video_url": {"url": "..."}}

A URL is `data:<mime>;base64,...`, `http(s)://...`, or a local file where the server allows
one (gateway/media/fetch.py). `detail` is accepted and ignored, as vLLM does: Gemma 3 sees
every image at its tower's one resolution. `uuid` (vLLM's client-given id of an item) is
accepted and passed on; the content hash, not the uuid, identifies an item.

`normalize_content` is ChatMessage.content's before-validator: a list of text parts only
becomes one string (the parts joined with newlines: the text path as it always was); a list
with an image or a video stays a list of typed parts, which only the prompt builder for
vision checkpoints (gateway/mm_prompt.py) reads. A bad part is reported at its own place,
`messages[i].content[j].image_url.url`, never at a pydantic union branch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError
from pydantic_core import InitErrorDetails

from gateway.request_part import RequestPart


class TextPart(RequestPart):
    # Exactly these two keys (normalize_content refuses others), unlike the media parts.
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})

    type: Literal["text"]
    text: str


class ImageURL(RequestPart):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, ignored (as vLLM)


class ImageURLPart(RequestPart):
    # "x-media": the document of a server that takes no images or video leaves this part out
    # (gateway/openapi_document.py); so for VideoURLPart.
    model_config = ConfigDict(json_schema_extra={"x-media": True})

    type: Literal["image_url"]
    image_url: ImageURL
    uuid: str | None = None

    @property
    def kind(self) -> Literal["image"]:
        return "image"

    @property
    def url(self) -> str:
        return self.image_url.url


class VideoURL(RequestPart):
    url: str


class VideoURLPart(RequestPart):
    model_config = ConfigDict(json_schema_extra={"x-media": True})

    type: Literal["video_url"]
    video_url: VideoURL
    uuid: str | None = None

    @property
    def kind(self) -> Literal["video"]:
        return "video"

    @property
    def url(self) -> str:
        return self.video_url.url


MediaContentPart = ImageURLPart | VideoURLPart
ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]
_PART_MODELS: dict[str, type[RequestPart]] = {"text": TextPart, "image_url": ImageURLPart, "video_url": VideoURLPart}


def normalize_content(value: Any) -> Any:
    """A message's content as the model keeps it: None, a string, or (with media) a list of
    typed parts. Raises ValueError (or a ValidationError located at the bad part)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content parts")
    parts: list[RequestPart] = []
    for i, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        model = _PART_MODELS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise ValueError(f"content part {i} has type {kind!r}: expected 'text', 'image_url' or 'video_url'")
        if model is TextPart and (set(part) - {"type", "text"} or not isinstance(part.get("text"), str)):
            raise ValueError(f"content part {i} must be {{'type': 'text', 'text': <string>}}")
        try:
            parts.append(model.model_validate(part))
        except ValidationError as exc:  # located at the part: content[i].image_url.url
            raise ValidationError.from_exception_data(exc.title, [_at_part(i, e) for e in exc.errors()]) from None
    if all(isinstance(p, TextPart) for p in parts):
        return "\n".join(p.text for p in parts)
    return parts


def _at_part(index: int, error: Any) -> InitErrorDetails:
    details = InitErrorDetails(type=error["type"], loc=(index, *error["loc"]), input=error["input"])
    if "ctx" in error:
        details["ctx"] = error["ctx"]
    return details
