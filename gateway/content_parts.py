"""The parts of a chat message's `content`, as OpenAI's (and vLLM's) chat API defines them:

    {"type": "text", "text": "..."}
    {"type": "image_url", "image_url": {"url": "...", "detail": "auto" | "low" | "high"}, "uuid": "..."}
    {"type": "video_url", "video_url": {"url": "..."}, "uuid": "..."}
    {"type": "image_url", "image_url": null, "uuid": "..."}    # media sent before under the uuid
    {"type": "file", "file": {"file_id": "file-...", "filename": "..."}}  # an uploaded image file

A URL is `data:<mime>;base64,...`, `http(s)://...`, or a local file where the server allows
one (gateway/media/fetch.py). `detail` is accepted and ignored, as vLLM does: Gemma 3 sees
every image at its tower's one resolution. `uuid` is vLLM's client-given id of an item: with
data it names them for later parts; without data (`image_url` / `video_url` null, as vLLM
takes it, or absent) the part is what was sent before under it (gateway/media/uuids.py). A
part has data or a uuid, or both; the content hash, not the uuid, identifies an item.

A `file` part is OpenAI's chat part for an uploaded file (OpenAI takes PDFs there): here it
names an image uploaded through the Files API (gateway/files/), the only kind of file this
server keeps, by `file_id`; `filename` is accepted and ignored, `file_data` (a file inline)
is refused: send an image inline as an image_url part.

`normalize_content` is ChatMessage.content's before-validator: a list of text parts only
becomes one string (the parts joined with newlines: the text path as it always was); a list
with an image or a video stays a list of typed parts, which only the prompt builder for
vision checkpoints (gateway/mm_prompt.py) reads. A bad part is reported at its own place,
`messages[i].content[j].image_url.url`, never at a pydantic union branch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import InitErrorDetails

from gateway.request_part import RequestPart
from gateway.schema_rules import present

_UUID = ("vLLM's id of this item, chosen by the client. With data, it names them for later "
         "parts; with `{kind}` null or absent, the part is the {noun} sent before under this uuid "
         "(a 400 `media_not_found` when none was, or it expired: --media-ttl-s after its last use). "
         "Scoped to the request's API key when the server has keys.")


class TextPart(RequestPart):
    # Exactly these two keys (normalize_content refuses others), unlike the media parts.
    model_config = ConfigDict(json_schema_extra={"additionalProperties": False})

    type: Literal["text"]
    text: str


class ImageURL(RequestPart):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # accepted, ignored (as vLLM)


def _media_part_schema(field: str) -> dict[str, Any]:
    """"x-media": the document of a server that takes no images or video leaves the part out
    (gateway/openapi_document.py); the rule: data, or a uuid naming data sent before."""
    return {"x-media": True,
            "anyOf": [present(field), {"properties": {"uuid": {"type": "string"}}, "required": ["uuid"]}]}


def _data_or_uuid(part: ImageURLPart | VideoURLPart, data: object) -> None:
    if data is None and part.uuid is None:
        raise ValueError(f"the {part.type} part needs '{part.type}' (an object with 'url') or, for media "
                         "sent before, their 'uuid'")


class ImageURLPart(RequestPart):
    model_config = ConfigDict(json_schema_extra=_media_part_schema("image_url"))

    type: Literal["image_url"]
    image_url: ImageURL | None = Field(None, description="The image; null or absent: the one sent before "
                                                         "under `uuid`.")
    uuid: str | None = Field(None, description=_UUID.format(kind="image_url", noun="image"))

    @model_validator(mode="after")
    def _has_data_or_uuid(self) -> ImageURLPart:
        _data_or_uuid(self, self.image_url)
        return self

    @property
    def kind(self) -> Literal["image"]:
        return "image"

    @property
    def url(self) -> str | None:
        """None: no data (the part names media sent before by its uuid)."""
        return None if self.image_url is None else self.image_url.url


class VideoURL(RequestPart):
    url: str


class VideoURLPart(RequestPart):
    model_config = ConfigDict(json_schema_extra=_media_part_schema("video_url"))

    type: Literal["video_url"]
    video_url: VideoURL | None = Field(None, description="The video; null or absent: the one sent before "
                                                         "under `uuid` (its frames as sampled then).")
    uuid: str | None = Field(None, description=_UUID.format(kind="video_url", noun="video"))

    @model_validator(mode="after")
    def _has_data_or_uuid(self) -> VideoURLPart:
        _data_or_uuid(self, self.video_url)
        return self

    @property
    def kind(self) -> Literal["video"]:
        return "video"

    @property
    def url(self) -> str | None:
        """None: no data (the part names media sent before by its uuid)."""
        return None if self.video_url is None else self.video_url.url


class FileRef(RequestPart):
    file_id: str = Field(min_length=1, description="The id of an image uploaded to /v1/files (a 400 "
                                                   "`file_not_found` when no such file is there for this "
                                                   "API key: never uploaded, deleted or expired).")
    filename: str | None = Field(None, description="Accepted, ignored.")
    file_data: None = Field(None, description="Refused (400) unless null: send an image inline as an "
                                              "image_url part.")

    @field_validator("file_data", mode="before")
    @classmethod
    def _no_inline_file(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("a file inline is not supported: send an image as an image_url part (a data: "
                             "URL), or upload it to /v1/files and name it by 'file_id'")
        return value


class FilePart(RequestPart):
    """OpenAI's chat part for an uploaded file: here an image file, by its id."""

    model_config = ConfigDict(json_schema_extra={"x-media": True})

    type: Literal["file"]
    file: FileRef

    @property
    def kind(self) -> Literal["image"]:
        return "image"

    @property
    def url(self) -> None:
        return None

    @property
    def uuid(self) -> None:
        return None

    @property
    def file_id(self) -> str:
        return self.file.file_id


MediaContentPart = ImageURLPart | VideoURLPart | FilePart
ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart | FilePart, Field(discriminator="type")]
_PART_MODELS: dict[str, type[RequestPart]] = {"text": TextPart, "image_url": ImageURLPart, "video_url": VideoURLPart,
                                              "file": FilePart}


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
            raise ValueError(f"content part {i} has type {kind!r}: expected 'text', 'image_url' or 'video_url', "
                             "or 'file' (an image uploaded to /v1/files)")
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
