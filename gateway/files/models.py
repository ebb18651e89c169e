"""What the Files API answers (OpenAI's `File`, its list and its deletion object) and what it
keeps in Redis per file (`FileRecord`, gateway-only msgpack).

A file id is `file-` + 32 hex digits: the upload's time in milliseconds (12 digits) and 20
random ones, so ids sort in upload order, and a list's `after` cursor keeps its place even
when the file it names is gone.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

import msgspec
from pydantic import BaseModel, Field

PURPOSES = ("vision", "user_data")  # what an image to ask about is uploaded as, in OpenAI's names
Purpose = Literal["vision", "user_data"]
_ID_HEX = 32


def new_file_id(now_s: float | None = None) -> str:
    millis = int((time.time() if now_s is None else now_s) * 1000)
    return f"file-{millis:012x}{secrets.token_hex(10)}"


def is_file_id(value: str) -> bool:
    """Whether `value` has the shape of this server's file ids (anything else names no file)."""
    digits = value.removeprefix("file-")
    return (value.startswith("file-") and len(digits) == _ID_HEX
            and all(c in "0123456789abcdef" for c in digits))


class FileRecord(msgspec.Struct, frozen=True):
    """One uploaded file, at `RedisKeys.file(scope, id)` until it expires. Its bytes are the
    media item `RedisKeys.media(content_hash)` (an image, as uploaded)."""

    id: str
    bytes: int
    created_at: int  # unix seconds
    expires_at: int
    filename: str
    purpose: str
    content_hash: str
    width: int
    height: int
    mime: str

    def file_object(self) -> FileObject:
        return FileObject(id=self.id, bytes=self.bytes, created_at=self.created_at, filename=self.filename,
                          purpose=self.purpose, expires_at=self.expires_at)


record_decoder = msgspec.msgpack.Decoder(FileRecord)
record_encoder = msgspec.msgpack.Encoder()


class FileObject(BaseModel):
    """OpenAI's File object: an uploaded image, checked and stored."""

    id: str = Field(description="The file's id (`file-...`), for `file_id` in requests and the file routes.")
    object: Literal["file"] = "file"
    bytes: int = Field(description="The file's size in bytes.")
    created_at: int = Field(description="When it was uploaded (unix seconds).")
    filename: str
    purpose: Purpose
    status: Literal["processed"] = Field("processed", description="Always processed: an upload is checked "
                                                                  "(a whole image) before it is answered.")
    expires_at: int = Field(description="When it expires (unix seconds): --file-ttl-s after the upload, or "
                                        "the upload's `expires_after[seconds]`.")
    status_details: None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: Literal[True] = True
