"""The Files API through the gateway (gateway/files/): upload, list, get, content, delete; an
image file named by `file_id` (the Responses API's input_image, chat's file part) makes the
same NewRequest as the image sent inline (same prompt, same content hash: every cache
downstream hits); unknown, deleted and expired ids are a 400 `file_not_found` in a request
and a 404 on the file routes; files expire (--file-ttl-s, `expires_after`); one file is at
most --max-media-bytes (413), all files together --max-file-storage-bytes (429 with
Retry-After); files are per API key. Tiny gemma3-vision checkpoint, real Redis, a fake
worker."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import redis

from gateway.app import create_app
from tests.support.gateway_helpers import MODEL, gateway_client, make_config, register_worker
from tests.support.gateway_image_helpers import MAX_MODEL_LEN, submitted, with_budget
from tests.support.media_helpers import data_url, file_bytes, picture
from proto.keys import RedisKeys

pytestmark = pytest.mark.anyio

FRAME = file_bytes(picture(3, 40, 30), "JPEG")
OTHER = file_bytes(picture(4, 24, 24), "PNG")
QUESTION = {"type": "text", "text": "What is in front of the camera?"}


def vision_config(vision_dir, redis_url, **overrides):
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0, **overrides)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    return config


@pytest.fixture
def config(vision_dir, redis_url):
    return vision_config(vision_dir, redis_url)


async def upload(client, data: bytes = FRAME, *, name: str = "frame.jpg", purpose: str = "vision",
                 headers: dict | None = None, **fields):
    return await client.post("/v1/files", files={"file": (name, data, "application/octet-stream")},
                             data={"purpose": purpose, **fields}, headers=headers or {})


def chat_by_file(file_id: str) -> dict:
    return {"messages": [{"role": "user", "content": [QUESTION, {"type": "file", "file": {"file_id": file_id}}]}]}


def responses_by_file(file_id: str) -> dict:
    return {"input": [{"role": "user", "content": [{"type": "input_text", "text": QUESTION["text"]},
                                                   {"type": "input_image", "file_id": file_id, "detail": "auto"}]}]}


def error_of(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error


def queued(config) -> int:
    return redis.Redis.from_url(config.redis_url).xlen(RedisKeys(config.key_prefix).requests)


async def test_upload_list_retrieve_download_delete(config):
    async with gateway_client(config) as client:
        before = time.time()
        response = await upload(client)
        assert response.status_code == 200, response.text
        made = response.json()
        assert made["id"].startswith("file-") and len(made["id"]) == 37
        assert {k: made[k] for k in ("object", "bytes", "filename", "purpose", "status")} == {
            "object": "file", "bytes": len(FRAME), "filename": "frame.jpg", "purpose": "vision", "status": "processed"}
        assert int(before) <= made["created_at"] <= time.time()
        assert made["expires_at"] - made["created_at"] in (3599, 3600)  # --file-ttl-s, in whole seconds
        second = (await upload(client, OTHER, name="other.png", purpose="user_data")).json()

        listed = (await client.get("/v1/files")).json()
        assert listed["object"] == "list" and listed["has_more"] is False
        assert [f["id"] for f in listed["data"]] == [second["id"], made["id"]]  # newest first
        assert (await client.get("/v1/files", params={"order": "asc"})).json()["data"][0] == made
        assert [f["id"] for f in (await client.get("/v1/files", params={"purpose": "vision"})).json()["data"]] == \
            [made["id"]]
        page = (await client.get("/v1/files", params={"limit": 1})).json()
        assert [f["id"] for f in page["data"]] == [second["id"]] and page["has_more"] is True
        rest = (await client.get("/v1/files", params={"limit": 1, "after": page["last_id"]})).json()
        assert [f["id"] for f in rest["data"]] == [made["id"]] and rest["has_more"] is False

        assert (await client.get(f"/v1/files/{made['id']}")).json() == made
        content = await client.get(f"/v1/files/{made['id']}/content")
        assert content.status_code == 200 and content.content == FRAME
        assert content.headers["content-type"] == "image/jpeg"

        deleted = await client.delete(f"/v1/files/{made['id']}")
        assert deleted.status_code == 200 and deleted.json() == {"id": made["id"], "object": "file", "deleted": True}
        for response in (await client.get(f"/v1/files/{made['id']}"),
                         await client.get(f"/v1/files/{made['id']}/content"),
                         await client.delete(f"/v1/files/{made['id']}")):
            assert error_of(response, 404, "file_not_found")["param"] == "file_id"
        assert [f["id"] for f in (await client.get("/v1/files")).json()["data"]] == [second["id"]]
        for unknown in ("file-" + "0" * 32, "nope"):
            error_of(await client.get(f"/v1/files/{unknown}"), 404, "file_not_found")
        # one route per method at a path: a 405 names them all
        assert (await client.put("/v1/files")).headers["allow"] == "GET, POST"
        assert (await client.post(f"/v1/files/{made['id']}")).headers["allow"] == "DELETE, GET"
        stored = await client.app.state.files.ledger.stored_bytes()
        assert stored == len(OTHER)  # the deleted file's bytes are free again


async def test_the_upload_is_stored_once_as_the_inline_images_media_item(config):
    keys, client_ = RedisKeys(config.key_prefix), redis.Redis.from_url(config.redis_url)
    async with gateway_client(config) as client:
        made = (await upload(client)).json()
    key = keys.media(hashlib.sha256(FRAME).hexdigest())
    assert client_.exists(key)
    assert 3590_000 < client_.pttl(key) <= 3600_000  # as long as the file lives
    # an inline request with the same bytes (the media TTL) never shortens it
    client_.pexpire(key, 7200_000)
    await submitted(config, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        QUESTION, {"type": "image_url", "image_url": {"url": data_url(FRAME, "image/jpeg")}}]}]})
    assert client_.pttl(key) > 7000_000
    assert made["bytes"] == len(FRAME)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
async def test_a_file_named_by_its_id_is_the_image_sent_inline(config, path):
    async with gateway_client(config) as client:
        file_id = (await upload(client)).json()["id"]
    inline_body = {"messages": [{"role": "user", "content": [
        QUESTION, {"type": "image_url", "image_url": {"url": data_url(FRAME, "image/jpeg")}}]}]}
    inline, _ = await submitted(config, "/v1/chat/completions", inline_body)
    named, answer = await submitted(config, path, chat_by_file(file_id) if path.endswith("completions")
                                    else responses_by_file(file_id))
    assert named.mm_inputs == inline.mm_inputs  # same placeholders, same hash
    assert [m.content_hash for m in named.mm_inputs] == [hashlib.sha256(FRAME).hexdigest()]
    assert named.prompt_token_ids == inline.prompt_token_ids
    assert answer["model"] == MODEL


async def test_unknown_deleted_and_expired_ids_are_a_400_at_once(vision_dir, redis_url):
    config = vision_config(vision_dir, redis_url, file_ttl_s=1.0)
    async with gateway_client(config) as client:
        deleted = (await upload(client)).json()["id"]
        assert (await client.delete(f"/v1/files/{deleted}")).status_code == 200
        expiring = (await upload(client)).json()["id"]
        await asyncio.sleep(1.2)
        for file_id in ("file-" + "0" * 32, "file-abc", deleted, expiring):
            for path, body, param in (
                    ("/v1/chat/completions", chat_by_file(file_id), "messages[0].content[1].file.file_id"),
                    ("/v1/responses", responses_by_file(file_id), "input[0].content[1].file_id")):
                started = time.monotonic()
                response = await client.post(path, json=with_budget(path, body))
                error = error_of(response, 400, "file_not_found")
                assert error["param"] == param and file_id in error["message"], error
                assert time.monotonic() - started < 2
            error_of(await client.get(f"/v1/files/{file_id}"), 404, "file_not_found")
        assert queued(config) == 0
        assert (await client.get("/v1/files")).json()["data"] == []  # the expired one is gone from the list
        assert await client.app.state.files.ledger.stored_bytes() == 0


async def test_expires_after_shortens_a_files_life_within_the_servers_ttl(vision_dir, redis_url):
    config = vision_config(vision_dir, redis_url, file_ttl_s=30.0)
    async with gateway_client(config) as client:
        short = (await upload(client, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "1"})).json()
        assert short["expires_at"] - short["created_at"] in (0, 1)
        long = (await upload(client, **{"expires_after[seconds]": "30.0"})).json()  # a whole float is a whole number
        assert long["expires_at"] - long["created_at"] in (29, 30)
        for bad in ("31", "0", "1.5", "soon"):
            error = error_of(await upload(client, **{"expires_after[seconds]": bad}), 400, "invalid_value")
            assert error["param"] == "expires_after[seconds]"
        error_of(await upload(client, **{"expires_after[anchor]": "last_used"}), 400, "invalid_value")
        await asyncio.sleep(1.2)
        error_of(await client.get(f"/v1/files/{short['id']}"), 404, "file_not_found")
        assert (await client.get(f"/v1/files/{long['id']}")).status_code == 200


async def test_one_file_and_all_files_are_bounded_in_bytes(vision_dir, redis_url):
    frames = [file_bytes(picture(seed, 32, 32), "PNG") for seed in range(4)]
    size = max(len(f) for f in frames)
    config = vision_config(vision_dir, redis_url, max_media_bytes=size + 10, max_file_storage_bytes=2 * size + 5,
                           file_ttl_s=3.0)
    async with gateway_client(config) as client:
        big = file_bytes(picture(9, 200, 200), "PNG")
        error = error_of(await upload(client, big), 413, "file_too_large")
        assert error["param"] == "file" and str(size + 10) in error["message"]
        kept = [(await upload(client, frames[i])).json() for i in range(2)]
        assert all("id" in k for k in kept)
        full = await upload(client, frames[2])
        error = error_of(full, 429, "file_storage_full")
        assert error["type"] == "insufficient_quota" and str(2 * size + 5) in error["message"]
        assert 1 <= int(full.headers["retry-after"]) <= 3  # when the first file expires
        assert (await client.delete(f"/v1/files/{kept[0]['id']}")).status_code == 200
        assert (await upload(client, frames[2])).status_code == 200  # room again
        error_of(await upload(client, frames[3]), 429, "file_storage_full")
        await asyncio.sleep(3.2)  # every file expired: all the room again
        assert (await upload(client, frames[3])).status_code == 200
        assert await client.app.state.files.ledger.stored_bytes() == len(frames[3])


async def test_files_are_per_api_key(vision_dir, redis_url):
    config = vision_config(vision_dir, redis_url, api_keys=("k1", "k2"))
    one, two = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    async with gateway_client(config) as client:
        assert (await upload(client)).status_code == 401  # no key
        assert (await client.get("/v1/files")).status_code == 401
        made = (await upload(client, headers=one)).json()
        assert [f["id"] for f in (await client.get("/v1/files", headers=one)).json()["data"]] == [made["id"]]
        assert (await client.get("/v1/files", headers=two)).json()["data"] == []
        for response in (await client.get(f"/v1/files/{made['id']}", headers=two),
                         await client.get(f"/v1/files/{made['id']}/content", headers=two),
                         await client.delete(f"/v1/files/{made['id']}", headers=two)):
            error_of(response, 404, "file_not_found")
        path = "/v1/chat/completions"
        error_of(await client.post(path, json=with_budget(path, chat_by_file(made["id"])), headers=two),
                 400, "file_not_found")
        assert (await client.get(f"/v1/files/{made['id']}", headers=one)).status_code == 200
    request, _ = await submitted_with(config, chat_by_file(made["id"]), one)
    assert [m.content_hash for m in request.mm_inputs] == [hashlib.sha256(FRAME).hexdigest()]


async def submitted_with(config, body: dict, headers: dict):
    """`submitted`, with headers (an API key)."""
    from tests.support.gateway_helpers import FakeWorker, token_events
    from proto.messages import NewRequest

    async with FakeWorker(config, lambda r: token_events(r.request_id, [40], "length")) as worker:
        async with gateway_client(config) as client:
            response = await client.post("/v1/chat/completions", json=with_budget("/v1/chat/completions", body),
                                         headers=headers)
            assert response.status_code == 200, response.text
            return (await worker.wait_for(NewRequest))[-1], response.json()


async def test_what_an_upload_refuses(config):
    async with gateway_client(config) as client:
        error_of(await client.post("/v1/files", json={"purpose": "vision"}), 400, "invalid_content_type")
        assert error_of(await client.post("/v1/files", data={"purpose": "vision"}, files={"other": ("x", b"x")}),
                        400, "missing_required_parameter")["param"] == "file"
        assert error_of(await client.post("/v1/files", files={"file": ("f.jpg", FRAME)}), 400,
                        "missing_required_parameter")["param"] == "purpose"
        assert error_of(await upload(client, purpose="batch"), 400, "invalid_value")["param"] == "purpose"
        assert error_of(await upload(client, b"not an image"), 400, "invalid_image")["param"] == "file"
        assert error_of(await upload(client, FRAME[: len(FRAME) // 2]), 400, "invalid_image")["param"] == "file"
        twice = await client.post("/v1/files", files=[("file", ("a.jpg", FRAME)), ("file", ("b.jpg", FRAME))],
                                  data={"purpose": "vision"})
        error_of(twice, 400, "invalid_value")
    small = vision_config(config.model, config.redis_url, max_image_pixels=100)
    async with gateway_client(small) as client:
        error_of(await upload(client), 400, "image_too_large")
    path = "/v1/chat/completions"
    inline_data = chat_by_file("file-" + "0" * 32)
    inline_data["messages"][0]["content"][1]["file"]["file_data"] = data_url(FRAME, "image/jpeg")
    async with gateway_client(config) as client:
        error_of(await client.post(path, json=with_budget(path, inline_data)), 400, "invalid_value")
        both = responses_by_file("file-" + "0" * 32)
        both["input"][0]["content"][1]["image_url"] = data_url(FRAME, "image/jpeg")
        error_of(await client.post("/v1/responses", json=with_budget("/v1/responses", both)), 400, "invalid_value")
    assert queued(config) == 0


def test_the_document_has_the_files_api_on_the_stack_only(vision_dir, tiny_model_dir):
    stack = create_app(make_config(vision_dir, "redis://127.0.0.1:1/0")).openapi()
    assert {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content"} <= set(stack["paths"])
    upload_body = stack["paths"]["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert upload_body["required"] == ["file", "purpose"]
    assert upload_body["properties"]["expires_after[seconds]"]["maximum"] == 3600
    assert "file_not_found" in stack["paths"]["/v1/responses"]["post"]["responses"]["400"]["x-beyond-schema"]
    assert "FilePart" in stack["components"]["schemas"]
    text = create_app(make_config(tiny_model_dir, "redis://127.0.0.1:1/0")).openapi()
    assert "FilePart" not in text["components"]["schemas"]  # a text model names no image file in a request
    assert text["paths"]["/v1/files"]["post"]["responses"]["400"]["x-beyond-schema"] == [
        "invalid_image", "image_too_large", "unsupported_image_format"]  # but keeps files
    engine = create_app(make_config(vision_dir, "redis://127.0.0.1:1/0"), backend_factory=lambda: None).openapi()
    assert not any(path.startswith("/v1/files") for path in engine["paths"])
