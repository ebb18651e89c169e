"""Media URLs are safe by default (gateway/media/address_policy.py, used by fetch.py): the
gateway fetches nothing inside the network it runs in unless `--allowed-media-networks`
opens it. Every spelling of an internal address is refused before anything connects (the
real local server in tests/support/media_server.py counts the connections it accepted: none), all
with one 400; a name is resolved once and the connection pinned to the address checked; a
redirect to an internal host is refused at the hop; refusals are counted in the gateway's
metrics. Every connection here is to loopback: other internal ranges are checked by
classification and by a resolver the tests control, and refused before any connection."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import re
import shutil
import ssl
import subprocess
import uuid
from collections.abc import Sequence
from urllib.parse import quote

import pytest
import redis.asyncio as aioredis
from prometheus_client import generate_latest

from gateway.config import add_cli_args, config_from_args
from gateway.errors import OpenAIError
from gateway.media.address_policy import (AddressGuard, AddressRefused, is_public, parse_networks,
                                          reached_address, system_resolve)
from gateway.media.fetch import FetchPolicy, Fetched, MediaFetcher
from gateway.media.loader import MediaLoader, MediaPart, MediaSettings
from gateway.media.store import MediaStore
from gateway.metrics import GatewayMetrics
from proto.env_flags import EnvFlags
from proto.keys import RedisKeys
from tests.support.gateway_helpers import make_config, register_worker
from tests.support.gateway_image_helpers import MAX_MODEL_LEN, refused as gateway_refused, submitted
from tests.support.media_helpers import PARAM, data_url, png, refused
from tests.support.media_server import MediaHandler, MediaServer, media_server

LOOPBACK = parse_networks("127.0.0.0/8")
# The one answer for every internal (or unresolvable) host: its host named, nothing about what is there.
NOT_ALLOWED = re.compile(r"The image URL's host '[^']+' does not resolve to a public address: media from "
                         r"addresses inside the server's network need --allowed-media-networks\.")
REDIRECTED = re.compile(r"The image URL was redirected to the host '[^']+', which does not resolve to a public "
                        r"address: media from addresses inside the server's network need --allowed-media-networks\.")


def resolver(names: dict[str, list[str]], calls: list[str] | None = None):
    """A resolver that maps `names` (recording every lookup in `calls`); others as the system does."""
    async def resolve(host: str, port: int) -> Sequence[str]:
        if calls is not None:
            calls.append(host)
        if host in names:
            return names[host]
        return await system_resolve(host, port)
    return resolve


async def fetch_all(urls: list[str], policy: FetchPolicy = FetchPolicy(),
                    resolve=system_resolve) -> tuple[list[Fetched | OpenAIError], MediaFetcher]:
    """Each URL fetched by one fetcher: what it got, or the error it raised."""
    fetcher = MediaFetcher(policy, resolve=resolve)
    out: list[Fetched | OpenAIError] = []
    try:
        for url in urls:
            try:
                out.append(await fetcher.fetch(url, "image", PARAM))
            except OpenAIError as exc:
                out.append(exc)
    finally:
        await fetcher.aclose()
    return out, fetcher


def run(coroutine):
    return asyncio.run(coroutine)


def assert_not_allowed(error, pattern: re.Pattern = NOT_ALLOWED) -> None:
    assert isinstance(error, OpenAIError), error
    assert (error.status, error.type, error.code, error.param) == (
        400, "invalid_request_error", "media_url_not_allowed", PARAM), error.message
    assert pattern.fullmatch(error.message), error.message


@pytest.fixture(scope="module")
def server():
    with media_server() as server:
        yield server


@pytest.fixture
def other_server():
    """A second server on another loopback address, a redirect's internal target."""
    with media_server("127.0.0.2") as server:
        yield server


# ---- classification (no connection at all) -------------------------------------------------------


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.255.255.254", "10.1.2.3", "172.16.0.1", "192.168.1.10", "100.64.0.1", "169.254.169.254",
    "0.0.0.0", "0.1.2.3", "224.0.0.1", "239.255.255.250", "255.255.255.255", "240.0.0.1", "192.0.0.8",
    "198.18.0.1", "192.0.2.1",
    "::1", "::", "fe80::1", "fe80::1%eth0", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "2001:db8::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1",  # mapped, IPv4-compatible
    "64:ff9b::7f00:1", "64:ff9b::a00:1", "64:ff9b:1::a00:1",  # NAT64 of internal addresses, local-use NAT64
    "2002:7f00:1::", "2002:c0a8:101::1",  # 6to4 of 127.0.0.1, 192.168.1.1
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
])
def test_internal_addresses_are_not_public(address):
    assert not is_public(ipaddress.ip_address(address))
    assert not AddressGuard().allows(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [
    "8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e",
    "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1",  # IPv4 through mapping, NAT64 (DNS64), 6to4
])
def test_public_addresses(address):
    assert is_public(ipaddress.ip_address(address))


def test_allowed_networks_open_internal_addresses_and_no_more():
    guard = AddressGuard(parse_networks("192.168.10.0/24, fd00::/8"))
    for address in ("192.168.10.7", "::ffff:192.168.10.7", "64:ff9b::c0a8:a07", "fd00::5", "8.8.8.8"):
        assert guard.allows(ipaddress.ip_address(address)), address
    for address in ("192.168.11.7", "127.0.0.1", "169.254.169.254", "fc00::1", "::1"):
        assert not guard.allows(ipaddress.ip_address(address)), address
    assert reached_address(ipaddress.ip_address("::ffff:192.168.10.7")) == ipaddress.ip_address("192.168.10.7")


def test_parse_networks():
    assert parse_networks("") == ()
    assert [str(n) for n in parse_networks(" 10.0.0.0/8,fd00::/8 ,, 10.0.0.0/8,127.0.0.1")] == [
        "10.0.0.0/8", "fd00::/8", "127.0.0.1/32"]
    for bad, words in (("10.0.0.0/33", "not a network in CIDR notation"), ("192.168.1.5/24", "host bits set"),
                       ("lan", "'lan'")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_networks(bad)


def test_the_guard_checks_every_address_a_name_resolves_to():
    names = {"mixed.example": ["127.0.0.1", "10.0.0.1"], "lan.example": ["10.0.0.1"], "none.example": [],
             "garbage.example": ["not-an-address"]}
    guard = AddressGuard(LOOPBACK, resolver(names))
    assert run(guard.check("127.1", 80)) == (ipaddress.ip_address("127.0.0.1"),)
    for host, reason in (("mixed.example", "private_address"), ("lan.example", "private_address"),
                         ("none.example", "unresolvable"), ("garbage.example", "unresolvable"),
                         ("no-such-host.invalid", "unresolvable"), ("a..b", "unresolvable")):
        with pytest.raises(AddressRefused) as exc_info:
            run(guard.check(host, 80))
        assert exc_info.value.reason == reason, host


# ---- fetches: refused before anything connects ----------------------------------------------------


def spellings(port: int) -> list[str]:
    """127.0.0.1 (where the server is) and this host, every way a URL can spell them."""
    hosts = ["127.0.0.1", "localhost", "LOCALHOST", "localhost.", "127.0.0.1.", "2130706433", "0177.0.0.1",
             "0x7f.0.0.1", "0x7f000001", "127.1", "0x7f.1", "0", "0.0.0.0", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]",
             "[0:0:0:0:0:ffff:127.0.0.1]", "[::1]", "[::]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]",
             "[fe80::1%25lo]", "user:secret@127.0.0.1"]
    return [f"http://{host}:{port}/ok.png" for host in hosts] + [f"https://127.0.0.1:{port}/ok.png"]


def test_no_spelling_of_an_internal_address_reaches_the_server(server: MediaServer):
    before = server.connections
    urls = spellings(server.port)
    results, fetcher = run(fetch_all(urls))
    for url, result in zip(urls, results):
        assert isinstance(result, OpenAIError), url
        assert_not_allowed(result)
    assert server.connections == before  # not one connection, let alone a request
    refusals = fetcher.stats.refused
    assert refusals["private_address"] + refusals["unresolvable"] == len(urls)
    assert refusals["domain_not_allowed"] == refusals["redirect"] == 0


def test_opened_networks_fetch_the_same_image(server: MediaServer):
    """With --allowed-media-networks 127.0.0.0/8 the spellings that resolve are fetched as before."""
    urls = [f"http://{host}:{server.port}/ok.png" for host in (
        "127.0.0.1", "localhost", "2130706433", "0x7f.0.0.1", "127.1", "[::ffff:127.0.0.1]")]
    results, fetcher = run(fetch_all(urls, FetchPolicy(allowed_networks=LOOPBACK)))
    for url, result in zip(urls, results):
        assert isinstance(result, Fetched), (url, result)
        assert result.data == MediaHandler.image and result.mime == "image/png"
    assert not any(fetcher.stats.refused.values())
    # an allowed network opens those addresses only: ::1 is not in 127.0.0.0/8
    results, _ = run(fetch_all([f"http://[::1]:{server.port}/ok.png"], FetchPolicy(allowed_networks=LOOPBACK)))
    assert_not_allowed(results[0])


def test_a_public_looking_name_that_resolves_inside_is_refused(server: MediaServer):
    before = server.connections
    resolve = resolver({"images.example.com": ["127.0.0.1"], "mixed.example.com": ["127.0.0.1", "10.0.0.1"]})
    urls = [f"http://images.example.com:{server.port}/ok.png", f"https://images.example.com:{server.port}/ok.png"]
    results, fetcher = run(fetch_all(urls, resolve=resolve))
    for result in results:
        assert_not_allowed(result)
    assert "'images.example.com'" in results[0].message
    # every address of a name is checked: one outside the opened networks refuses the name
    results, _ = run(fetch_all([f"http://mixed.example.com:{server.port}/ok.png"],
                               FetchPolicy(allowed_networks=LOOPBACK), resolve))
    assert_not_allowed(results[0])
    assert server.connections == before
    assert fetcher.stats.refused["private_address"] == 2


def test_a_listed_domain_still_needs_its_network(server: MediaServer):
    """--allowed-media-domains says which names may be fetched, not where they may point: a
    domain list does not stop a listed name from being rebound inside."""
    resolve = resolver({"images.example.com": ["127.0.0.1"]})
    url = f"http://images.example.com:{server.port}/ok.png"
    results, _ = run(fetch_all([url], FetchPolicy(allowed_domains=("images.example.com",)), resolve))
    assert_not_allowed(results[0])
    results, _ = run(fetch_all([url], FetchPolicy(allowed_domains=("images.example.com",),
                                                  allowed_networks=LOOPBACK), resolve))
    assert isinstance(results[0], Fetched) and results[0].data == MediaHandler.image


def test_the_connection_is_pinned_to_the_address_checked(server: MediaServer):
    """The name is resolved once per hop, by the guard: the connection goes to the address it
    checked (the system cannot resolve `cdn.example` at all), with the name as Host."""
    calls: list[str] = []
    resolve = resolver({"cdn.example": ["127.0.0.1"]}, calls)
    paths = len(server.paths)
    results, _ = run(fetch_all([f"http://cdn.example:{server.port}/redirect"],
                               FetchPolicy(allowed_networks=LOOPBACK), resolve))
    assert isinstance(results[0], Fetched) and results[0].data == MediaHandler.image
    assert calls == ["cdn.example", "cdn.example"]  # the first hop and the redirect's, once each
    assert server.paths[paths:] == ["/redirect", "/ok.png"]
    assert server.hosts[paths:] == [f"cdn.example:{server.port}"] * 2


def make_certificate(folder) -> tuple[str, str, str]:
    """A test CA and a server certificate for the name cdn.example signed by it, with openssl:
    (ca.pem, cert.pem, key.pem)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=folder)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    openssl("req", *ec, "-keyout", "key.pem", "-out", "leaf.csr", "-subj", "/CN=cdn.example")
    (folder / "leaf.ext").write_text("subjectAltName=DNS:cdn.example\nbasicConstraints=CA:FALSE\n"
                                     "extendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "cert.pem", "-days", "1", "-extfile", "leaf.ext")
    return str(folder / "ca.pem"), str(folder / "cert.pem"), str(folder / "key.pem")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_https_is_pinned_with_the_name_as_server_name(tmp_path, monkeypatch):
    """Over TLS the pinned connection (to 127.0.0.1) sends the name as SNI and checks the
    certificate against the name: the certificate for cdn.example is accepted for that name
    only, not for another name or the bare address. The CA comes from SSL_CERT_FILE, which the
    fetcher still reads (it reads no proxy from the environment)."""
    ca, cert, key = make_certificate(tmp_path)
    names: list[str | None] = []
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    tls.sni_callback = lambda sock, name, context: names.append(name)
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # ignored: the connection is the fetcher's own
    with media_server(tls=tls) as server:
        resolve = resolver({"cdn.example": ["127.0.0.1"], "other.example": ["127.0.0.1"]})
        urls = [f"https://{host}:{server.port}/ok.png" for host in ("cdn.example", "other.example", "127.0.0.1")]
        results, _ = run(fetch_all(urls, FetchPolicy(allowed_networks=LOOPBACK), resolve))
        assert isinstance(results[0], Fetched) and results[0].data == MediaHandler.image
        assert server.hosts == [f"cdn.example:{server.port}"]
        for result in results[1:]:
            assert result.code == "media_fetch_failed" and "CERTIFICATE_VERIFY_FAILED" in result.message
    assert names[:2] == ["cdn.example", "other.example"]


def test_a_redirect_to_an_internal_host_is_refused_at_the_hop(server: MediaServer, other_server: MediaServer):
    """An opened host (127.0.0.1/32) redirects to internal addresses outside the opened network:
    each refused at the hop, and the target sees nothing."""
    resolve = resolver({"cdn.example": ["127.0.0.1"], "internal.example": ["127.0.0.2"]})
    targets = [f"{other_server.url}/ok.png", f"http://internal.example:{other_server.port}/ok.png",
               f"http://[::1]:{other_server.port}/ok.png", f"http://2130706434:{other_server.port}/ok.png"]
    urls = [f"http://cdn.example:{server.port}/redirect-to?url={quote(t, safe='')}" for t in targets]
    opened = parse_networks("127.0.0.1/32")
    results, fetcher = run(fetch_all(urls, FetchPolicy(allowed_networks=opened), resolve))
    for result in results:
        assert_not_allowed(result, REDIRECTED)
    assert other_server.connections == 0
    assert fetcher.stats.refused["redirect"] == len(targets)
    assert sum(fetcher.stats.refused.values()) == len(targets)
    # the control: with the target's network opened, the same redirect reaches it
    results, _ = run(fetch_all(urls[:1], FetchPolicy(allowed_networks=LOOPBACK), resolve))
    assert isinstance(results[0], Fetched) and other_server.paths == ["/ok.png"]


def test_public_hosts_keep_their_detailed_errors(server: MediaServer):
    """What differs between hosts in an opened network (and public ones) is still told."""
    urls = [f"{server.url}/missing.png", f"{server.url}/redirect-file"]
    results, _ = run(fetch_all(urls, FetchPolicy(allowed_networks=LOOPBACK)))
    assert [r.code for r in results] == ["media_fetch_failed"] * 2
    assert "HTTP 404" in results[0].message and "non-http(s)" in results[1].message


# ---- what is not fetched over the network is unaffected -------------------------------------------


def test_data_urls_and_local_files_are_unaffected(tmp_path):
    (tmp_path / "a.png").write_bytes(png())
    policy = FetchPolicy(allowed_local_path=str(tmp_path))  # no network opened
    results, fetcher = run(fetch_all([data_url(png()), f"file://{tmp_path}/a.png", "a.png"], policy))
    assert [r.data for r in results] == [png()] * 3
    assert not any(fetcher.stats.refused.values())


@pytest.mark.anyio
async def test_uuids_are_unaffected(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    loader = MediaLoader(MediaSettings(), MediaStore(client, RedisKeys(f"guard-{uuid.uuid4().hex[:8]}"), 60))
    try:
        sent = await loader.load([MediaPart("image", data_url(png()), PARAM, uuid="cam-1")])
        named = await loader.load([MediaPart("image", None, PARAM, uuid="cam-1")])
        assert named[0].content_hash == sent[0].content_hash
    finally:
        await loader.aclose()
        await client.aclose()


# ---- flags and metrics ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    flags = EnvFlags(argparse.ArgumentParser())
    add_cli_args(flags)
    return flags.parser


def test_the_flag_from_the_environment_is_checked_at_startup(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_ALLOWED_MEDIA_NETWORKS", "192.168.10.0/24")
    config = config_from_args(parser().parse_args(["--model", "m"]))
    assert config.allowed_media_networks == ("192.168.10.0/24",)
    assert MediaSettings.from_config(config).fetch.allowed_networks == parse_networks("192.168.10.0/24")
    monkeypatch.setenv("PAGEDSERVE_ALLOWED_MEDIA_NETWORKS", "192.168.10.0/33")
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", "m"])
    assert "'192.168.10.0/33' is not a network in CIDR notation" in capsys.readouterr().err


@pytest.mark.anyio
async def test_metrics_count_refusals_by_reason(server: MediaServer):
    metrics = GatewayMetrics("m")
    before = generate_latest(metrics.registry).decode()
    for reason in ("domain_not_allowed", "private_address", "unresolvable", "redirect"):
        assert f'pagedserve:mm_fetch_refused_total{{model_name="m",reason="{reason}"}} 0.0' in before
    client = aioredis.Redis.from_url("redis://127.0.0.1:1")  # never used: nothing is stored
    resolve = resolver({"cdn.example": ["127.0.0.1"]})
    fetcher = MediaFetcher(FetchPolicy(allowed_domains=("cdn.example", "localhost")), resolve=resolve)
    loader = MediaLoader(MediaSettings(), MediaStore(client, RedisKeys("unused"), 60), fetcher)
    metrics.media.loader = loader
    try:
        for url in (f"http://cdn.example:{server.port}/ok.png", f"http://localhost:{server.port}/ok.png",
                    f"http://elsewhere.example:{server.port}/ok.png"):
            with pytest.raises(OpenAIError) as exc_info:
                await loader.load([MediaPart("image", url, PARAM)])
        refused(exc_info, "media_domain_not_allowed", "'elsewhere.example' is not allowed")
    finally:
        await loader.aclose()
        await client.aclose()
    text = generate_latest(metrics.registry).decode()
    assert 'pagedserve:mm_fetch_refused_total{model_name="m",reason="private_address"} 2.0' in text
    assert 'pagedserve:mm_fetch_refused_total{model_name="m",reason="domain_not_allowed"} 1.0' in text


# ---- through the gateway ------------------------------------------------------------------------


def chat(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look"},
                                                       {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.mark.anyio
async def test_the_gateway_refuses_internal_urls_by_default_and_fetches_when_opened(
        vision_dir, redis_url, server: MediaServer):
    url = f"http://localhost:{server.port}/ok.png"
    before = server.connections
    config = make_config(vision_dir, redis_url, request_timeout_s=5.0)
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    await gateway_refused(config, "/v1/chat/completions", chat(url), "media_url_not_allowed",
                          "'localhost' does not resolve to a public address", "--allowed-media-networks",
                          param="messages[0].content[1].image_url.url")
    assert server.connections == before

    config = make_config(vision_dir, redis_url, request_timeout_s=5.0, allowed_media_networks=("127.0.0.0/8",))
    register_worker(config, max_model_len=MAX_MODEL_LEN)
    request, answer = await submitted(config, "/v1/chat/completions", chat(url))
    assert answer["choices"][0]["finish_reason"] == "length" and request.mm_inputs
    assert server.paths[-1] == "/ok.png"
