"""Fetching media for the gateway (gateway/media/fetch.py): data: URLs, http(s) from a real
local HTTP server (redirects, caps, timeouts, allowed domains), and local files only below
the allowed folder. Every refusal is a 400 with OpenAI's error fields, naming the part.
The server is on loopback, which the gateway fetches from only when told to: these tests
open 127.0.0.0/8 (what is refused without it: tests/unit/gateway/test_media_address_policy.py)."""

import asyncio
import base64
import time

import pytest

from compose.launcher import free_port
from gateway.errors import OpenAIError
from gateway.media.address_policy import parse_networks
from gateway.media.fetch import FetchPolicy, MediaFetcher
from tests.support.media_helpers import PARAM, data_url, png, refused
from tests.support.media_server import MediaHandler


# ---- data: URLs ----------------------------------------------------------------------------


def fetch(url: str, kind: str = "image", policy: FetchPolicy = FetchPolicy()):
    async def run():
        fetcher = MediaFetcher(policy)
        try:
            return await fetcher.fetch(url, kind, PARAM)
        finally:
            await fetcher.aclose()
    return asyncio.run(run())


def test_data_url_decodes_and_tolerates_line_breaks():
    data = png()
    wrapped = base64.encodebytes(data).decode()  # 76-column lines
    fetched = fetch(f"data:image/png;base64,{wrapped}")
    assert fetched.data == data and fetched.mime == "image/png"
    assert fetch(data_url(data, "application/octet-stream")).data == data


@pytest.mark.parametrize("url, code, words", [
    ("data:image/png;base64,not*base64!", "invalid_base64", ["not valid base64"]),
    ("data:image/png;base64,iVBORw0KGgo", "invalid_base64", ["not valid base64"]),  # bad padding
    ("data:image/png,rawdata", "invalid_base64", ["must be base64"]),
    ("data:text/plain;base64,aGVsbG8=", "invalid_media_type", ["'text/plain'", "image/*"]),
    ("data:video/mp4;base64,aGVsbG8=", "invalid_media_type", ["'video/mp4'"]),
    ("data:image/png;base64", "invalid_media_url", ["no ','"]),
    ("ftp://example.com/a.png", "invalid_media_url", ["unsupported scheme 'ftp'"]),
    ("", "invalid_media_url", ["empty"]),
])
def test_bad_data_urls(url, code, words):
    with pytest.raises(OpenAIError) as exc_info:
        fetch(url)
    refused(exc_info, code, *words)


def test_data_url_over_the_byte_cap():
    with pytest.raises(OpenAIError) as exc_info:
        fetch(data_url(b"x" * 3000), policy=FetchPolicy(max_bytes=1000))
    refused(exc_info, "media_too_large", "limit is 1000 bytes")


# ---- http(s):// against a real local server --------------------------------------------


LOOPBACK = parse_networks("127.0.0.0/8")
OPEN = FetchPolicy(allowed_networks=LOOPBACK)


def test_http_fetch_and_redirect(http_server):
    fetched = fetch(f"{http_server}/ok.png", policy=OPEN)
    assert fetched.data == MediaHandler.image and fetched.mime == "image/png"
    assert fetch(f"{http_server}/redirect", policy=OPEN).data == MediaHandler.image
    policy = FetchPolicy(allowed_domains=("127.0.0.1",), allowed_networks=LOOPBACK)
    assert fetch(f"{http_server}/redirect", policy=policy).data == MediaHandler.image


@pytest.mark.parametrize("path, policy, code, words", [
    ("/missing.png", OPEN, "media_fetch_failed", ["HTTP 404"]),
    ("/loop", OPEN, "media_fetch_failed", ["more than 5 redirects"]),
    ("/redirect-file", OPEN, "media_fetch_failed", ["non-http(s)"]),
    ("/declared-big", FetchPolicy(max_bytes=10_000, allowed_networks=LOOPBACK), "media_too_large",
     ["1000000000 bytes"]),
    ("/streamed-big", FetchPolicy(max_bytes=10_000, allowed_networks=LOOPBACK), "media_too_large",
     ["limit is 10000 bytes"]),
    ("/slow", FetchPolicy(timeout_s=0.3, allowed_networks=LOOPBACK), "media_fetch_failed",
     ["no answer within 0.3 s"]),
    ("/ok.png", FetchPolicy(allowed_domains=("media.example",), allowed_networks=LOOPBACK),
     "media_domain_not_allowed", ["'127.0.0.1' is not allowed", "media.example"]),
    # every hop is checked: allowed at first, redirected to a host that is not
    ("/redirect-elsewhere", FetchPolicy(allowed_domains=("127.0.0.1",), allowed_networks=LOOPBACK),
     "media_domain_not_allowed", ["redirected to the host 'localhost'"]),
])
def test_http_refusals(http_server, path, policy, code, words):
    started = time.monotonic()
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"{http_server}{path}", policy=policy)
    refused(exc_info, code, *words)
    assert time.monotonic() - started < 1.5  # the slow server is cut off at its deadline


def test_connection_refused():
    """In an allowed network, errors are as detailed as for a public host; outside one, a
    closed port answers like any internal address."""
    url = f"http://127.0.0.1:{free_port()}/a.png"
    with pytest.raises(OpenAIError) as exc_info:
        fetch(url, policy=OPEN)
    refused(exc_info, "media_fetch_failed", "could not connect")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(url)
    refused(exc_info, "media_url_not_allowed", "--allowed-media-networks")


# ---- local files -------------------------------------------------------------------------


def test_local_files_only_below_the_allowed_folder(tmp_path):
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png())
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    policy = FetchPolicy(allowed_local_path=str(root))

    assert fetch(f"file://{root}/sub/a.png", policy=policy).data == png()
    assert fetch(str(root / "sub" / "a.png"), policy=policy).data == png()
    assert fetch("sub/a.png", policy=policy).data == png()  # relative: below the folder
    for url in (f"file://{tmp_path}/secret.png", f"{root}/../secret.png", str(root / "escape.png"),
                "../secret.png"):
        with pytest.raises(OpenAIError) as exc_info:
            fetch(url, policy=policy)
        refused(exc_info, "local_media_not_allowed", "outside the folder")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"file://{root}/sub/a.png")  # no folder allowed
    refused(exc_info, "local_media_not_allowed", "--allowed-local-media-path")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"file://{root}/nothing.png", policy=policy)
    refused(exc_info, "media_fetch_failed", "does not exist")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"file://{root}/sub", policy=policy)
    refused(exc_info, "media_fetch_failed", "cannot be read")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"file://{root}/sub/a.png", policy=FetchPolicy(allowed_local_path=str(root), max_bytes=10))
    refused(exc_info, "media_too_large")
    with pytest.raises(OpenAIError) as exc_info:
        fetch(f"file://otherhost{root}/sub/a.png", policy=policy)
    refused(exc_info, "invalid_media_url", "'otherhost'")


