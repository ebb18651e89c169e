"""The Files API's routes, OpenAI's, for images (gateway/files/ keeps them):

    POST   /v1/files                    multipart upload → File object (200)
    GET    /v1/files                    ?purpose, limit (1-10000), order (asc|desc), after → list
    GET    /v1/files/{file_id}          File object; 404 `file_not_found`
    GET    /v1/files/{file_id}/content  the bytes as uploaded, typed by their image format
    DELETE /v1/files/{file_id}          {"id", "object": "file", "deleted": true}; 404

Served by the stack only (files live in Redis): `create_app` includes `router(...)` when it
has a Redis backend. Per API key (gateway/media/uuids.py `media_scope`): a key sees, names
and deletes only the files it uploaded; without keys every client shares them. The store is
`app.state.files` (made in the app's lifespan); gateway/auth.py guards these routes as every
/v1 route.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from gateway.errors import OpenAIError
from gateway.files.models import FileDeleted, FileList, FileObject
from gateway.files.store import FileStore
from gateway.files.upload import read_upload, upload_schema
from gateway.media.images import MIME_TYPES
from gateway.media.uuids import media_scope
from gateway.openapi_answers import FILE_UPLOAD_BEYOND, FILES_PATH, error_responses

_NOT_FOUND = "No such file here (`file_not_found`): never uploaded with this API key, deleted, or expired."
_DESCRIBED = {
    404: _NOT_FOUND,
    413: "The file is over --max-media-bytes, or larger than --max-file-storage-bytes (`file_too_large`); "
         "a body far over it closes the connection.",
    429: "Stored files take --max-file-storage-bytes (`file_storage_full`): delete some, or retry after "
         "`Retry-After` seconds, when enough will have expired.",
}
_BY_ID = {"parameters": {"file_id": "$response.body#/id"}}
_LINKS = {"RetrieveFile": {"operationId": "retrieveFile", **_BY_ID},
          "DownloadFile": {"operationId": "downloadFile", **_BY_ID},
          "DeleteFile": {"operationId": "deleteFile", **_BY_ID}}


def _files(request: Request) -> FileStore:
    return request.app.state.files


def _scope(request: Request) -> str:
    return media_scope(request.headers.get("authorization"), keyed=bool(request.app.state.config.api_keys))


def _not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such file: {file_id!r} (never uploaded with this API key, deleted, or "
                            "expired).", param="file_id", code="file_not_found")


async def create_file(request: Request) -> FileObject:
    """Upload an image (OpenAI's `client.files.create(file=..., purpose="vision")`), to name it
    by its id in later requests: the Responses API's input_image `file_id`, chat's file part."""
    config = request.app.state.config
    body = await read_upload(request, max_file_bytes=config.max_media_bytes, max_ttl_s=config.file_ttl_s)
    return (await _files(request).create(_scope(request), body)).file_object()


async def list_files(request: Request, purpose: str | None = None,
                     limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", after: str | None = None) -> FileList:
    """This API key's files, newest first (`order=asc`: oldest first), after the file `after`."""
    return await _files(request).list_files(_scope(request), purpose=purpose, limit=limit, order=order,
                                            after=after)


async def retrieve_file(request: Request, file_id: str) -> FileObject:
    record = await _files(request).get(_scope(request), file_id)
    if record is None:
        raise _not_found(file_id)
    return record.file_object()


async def download_file(request: Request, file_id: str) -> Response:
    content = await _files(request).content(_scope(request), file_id)
    if content is None:
        raise _not_found(file_id)
    data, mime = content
    return Response(data, media_type=mime)


async def delete_file(request: Request, file_id: str) -> FileDeleted:
    if not await _files(request).delete(_scope(request), file_id):
        raise _not_found(file_id)
    return FileDeleted(id=file_id)


def router(file_ttl_s: float) -> APIRouter:
    """The five routes, for a server whose files live at most `file_ttl_s` (the bound of
    `expires_after` the upload's documented body states, hence a router per app)."""
    files = APIRouter()
    upload = {200: {"description": "The file, stored.", "links": _LINKS}}
    files.add_api_route(
        FILES_PATH, create_file, methods=["POST"], operation_id="createFile", response_model=FileObject,
        responses={**upload, **error_responses(400, 413, 429, 500, 503, beyond=FILE_UPLOAD_BEYOND,
                                               described=_DESCRIBED)},
        openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {
            "schema": upload_schema(file_ttl_s)}}}})
    files.add_api_route(FILES_PATH, list_files, methods=["GET"], operation_id="listFiles",
                        responses=error_responses(400, 500, 503))
    files.add_api_route(FILES_PATH + "/{file_id}", retrieve_file, methods=["GET"], operation_id="retrieveFile",
                        responses=error_responses(404, 500, 503, described=_DESCRIBED))
    files.add_api_route(
        FILES_PATH + "/{file_id}/content", download_file, methods=["GET"], operation_id="downloadFile",
        response_class=Response,
        responses={200: {"description": "The file's bytes as uploaded, typed by their image format.",
                         "content": {mime: {"schema": {"type": "string", "format": "binary"}}
                                     for mime in MIME_TYPES}},
                   **error_responses(404, 500, 503, described=_DESCRIBED)})
    files.add_api_route(FILES_PATH + "/{file_id}", delete_file, methods=["DELETE"], operation_id="deleteFile",
                        responses=error_responses(404, 500, 503, described=_DESCRIBED))
    return files
