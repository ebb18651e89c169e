"""POST /v1/files' body, as the official `openai` client sends it (`client.files.create(file=...,
purpose=...)`): multipart/form-data with

    file                     the image file (its part's filename is the file's name)
    purpose                  "vision" or "user_data"
    expires_after[anchor]    optional, "created_at" (OpenAI's one anchor)
    expires_after[seconds]   optional, 1 to --file-ttl-s: the file expires that long after
                             the upload (default: --file-ttl-s)

read under a byte cap (413 `file_too_large` beyond it: the file over --max-media-bytes) and checked field by
field, each failure an OpenAI 400 naming the field. Other form fields are ignored, as
unknown JSON fields are. `UPLOAD_SCHEMA` is what /openapi.json publishes for it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from gateway.errors import OpenAIError, invalid
from gateway.files.models import PURPOSES
from gateway.preflight import read_body

FIELD_BYTES = 64 * 2**10  # a form field other than the file (and the multipart framing)
MAX_FILENAME = 512
_ANCHOR, _SECONDS = "expires_after[anchor]", "expires_after[seconds]"


@dataclass(frozen=True)
class FileUpload:
    data: bytes
    filename: str
    purpose: str
    ttl_s: float


def upload_schema(max_ttl_s: float) -> dict[str, Any]:
    """The multipart body's JSON Schema (OpenAPI 3.1), for a server whose files live at most `max_ttl_s`."""
    return {"type": "object", "properties": {
        "file": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream",
                 "description": "An image: PNG, JPEG, WEBP, GIF or BMP, at most --max-media-bytes and "
                                "--max-image-pixels; anything else is a 400 naming `file`."},
        "purpose": {"enum": list(PURPOSES)},
        _ANCHOR: {"const": "created_at", "description": "OpenAI's one anchor of `expires_after`."},
        _SECONDS: {"type": "integer", "minimum": 1, "maximum": _most_seconds(max_ttl_s),
                   "description": "The file expires this long after its upload (default and most: "
                                  "--file-ttl-s)."}},
        "required": ["file", "purpose"]}


async def read_upload(request: Request, *, max_file_bytes: int, max_ttl_s: float) -> FileUpload:
    """The upload in `request`'s body; 413 for a file over `max_file_bytes`, 400 for the rest."""
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        raise invalid("Upload a file as multipart/form-data with the fields 'file' and 'purpose'.",
                      code="invalid_content_type")
    try:
        body = await read_body(request, max_file_bytes + FIELD_BYTES)
    except OpenAIError as exc:  # far over: drained, the connection closes
        raise OpenAIError(413, f"{exc.message} The file may be at most {max_file_bytes} bytes (--max-media-bytes).",
                          param="file", code="file_too_large", headers=exc.headers) from None
    try:
        form = await MultiPartParser(request.headers, _once(body), max_files=4, max_fields=16,
                                     max_part_size=FIELD_BYTES).parse()
    except MultiPartException as exc:
        raise invalid(f"The multipart body cannot be read: {exc}", code="invalid_multipart") from None
    try:
        fields: dict[str, list[str | UploadFile]] = {}
        for name, value in form.multi_items():
            fields.setdefault(name, []).append(value)
        file = _one(fields, "file", required=True)
        data = await file.read() if isinstance(file, UploadFile) else file.encode()
        filename = (file.filename if isinstance(file, UploadFile) else None) or "file"
        purpose = _text(fields, "purpose", required=True)
        anchor = _text(fields, _ANCHOR)
        seconds = _text(fields, _SECONDS)
    finally:
        await form.close()
    if len(data) > max_file_bytes:
        raise OpenAIError(413, f"The file is {len(data)} bytes; the limit is {max_file_bytes} bytes "
                               "(--max-media-bytes).", param="file", code="file_too_large")
    if not data:
        raise invalid("The file is empty.", param="file", code="invalid_image")
    if purpose not in PURPOSES:
        raise invalid(f"Invalid value for 'purpose': {purpose!r}; this server keeps images to ask about: "
                      f"{' or '.join(repr(p) for p in PURPOSES)}.", param="purpose", code="invalid_value")
    if anchor is not None and anchor != "created_at":
        raise invalid(f"Invalid value for '{_ANCHOR}': {anchor!r}; the one anchor is 'created_at'.",
                      param=_ANCHOR, code="invalid_value")
    return FileUpload(data, filename[:MAX_FILENAME], purpose, _ttl(seconds, max_ttl_s))


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _one(fields: dict[str, list[str | UploadFile]], name: str, *, required: bool = False) -> str | UploadFile | None:
    values = fields.get(name, [])
    if len(values) > 1:
        raise invalid(f"'{name}' is given {len(values)} times; give it once.", param=name, code="invalid_value")
    if not values and required:
        raise invalid(f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
    return values[0] if values else None


def _text(fields: dict[str, list[str | UploadFile]], name: str, *, required: bool = False) -> str | None:
    value = _one(fields, name, required=required)
    if isinstance(value, UploadFile):
        raise invalid(f"'{name}' must be a form field, not a file.", param=name, code="invalid_value")
    return value


def _ttl(seconds: str | None, max_ttl_s: float) -> float:
    """`expires_after[seconds]` (a whole number, as JSON Schema's integer: 17.0 is 17) within
    1 .. max_ttl_s; absent: max_ttl_s."""
    if seconds is None:
        return max_ttl_s
    try:
        value = float(seconds.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not value.is_integer():
        raise invalid(f"Invalid value for '{_SECONDS}': {seconds!r} is not a whole number of seconds.",
                      param=_SECONDS, code="invalid_value")
    if not 1 <= value <= _most_seconds(max_ttl_s):
        raise invalid(f"Invalid value for '{_SECONDS}': {int(value)}; files live 1 to {_most_seconds(max_ttl_s)} "
                      "seconds here (--file-ttl-s).", param=_SECONDS, code="invalid_value")
    return min(value, max_ttl_s)


def _most_seconds(max_ttl_s: float) -> int:
    return max(1, math.floor(max_ttl_s))
