"""A media URL from a content part → its bytes, or an OpenAI-style 400 saying why not.

Three sources, each with the guard vLLM puts on it:
- `data:<mime>;base64,<data>`: the mime type must be one of the part's kind (`image/*` for
  an image, `video/*` for a video; `application/octet-stream` for either: the decoder then
  says what it is), the payload strict base64 (whitespace allowed, as e-mail-style line
  wrapping puts there), its size checked before it is decoded.
- `http://`, `https://`: fetched with httpx, one deadline over the whole fetch (connecting,
  every redirect, every byte: a server that drips bytes cannot hold it longer), the size
  checked against Content-Length first and counted while streaming, at most MAX_REDIRECTS
  redirects, each followed by hand so that every hop is checked before anything connects:
  its host against `--allowed-media-domains` (exact host names) when that list is set, then
  every address the host resolves to against the address policy (address_policy.py): safe
  by default, a host that resolves to an address inside the server's network (loopback,
  private, link-local, ...) is refused unless `--allowed-media-networks` holds it. The
  connection is then pinned to a checked address: the request goes to that IP with the Host
  header and the TLS server name (SNI, certificate check) of the URL's name, so the name is
  never resolved again (no DNS rebinding between check and connection). Pinning is why the
  client keeps no idle connections (a pooled connection is keyed by IP, and must not serve
  another name) and reads no proxy from the environment (HTTP_PROXY and the like): the
  gateway connects to media hosts itself, to the address it checked. CA bundles from
  SSL_CERT_FILE / SSL_CERT_DIR are still used.
  Every refusal of an internal address (and of a host that resolves to nothing) is the same
  400, `media_url_not_allowed`, whatever lies behind it, so answers do not map the network;
  public hosts keep their detailed errors. Refusals are counted by reason (`stats`).
- `file://` URLs and plain paths (a relative one is taken below the allowed folder): only
  with `--allowed-local-media-path`, and only for files that resolve, symlinks followed,
  to somewhere below that folder; read in a thread.

Whether the bytes are a valid image or video is the decoders' business (images.py,
video.py). One `MediaFetcher` per gateway: it owns the httpx client (a connection pool).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit

import httpx

from gateway.errors import OpenAIError, invalid
from gateway.media.address_policy import (NETWORKS_FLAG, REFUSAL_REASONS, AddressGuard, AddressRefused, IPAddress,
                                          IPNetwork, RefusalReason, Resolve, system_resolve)

MediaKind = Literal["image", "video"]
MAX_REDIRECTS = 5
_CHUNK_BYTES = 64 * 2**10
_GENERIC_MIME = "application/octet-stream"
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class FetchPolicy:
    """Where media may come from and how much of it (GatewayConfig's media fields)."""

    timeout_s: float = 10.0
    max_bytes: int = 20 * 2**20
    allowed_domains: tuple[str, ...] = ()  # empty: any host
    # non-public addresses (loopback, private, link-local, ...) that may be fetched; empty: none
    allowed_networks: tuple[IPNetwork, ...] = ()
    allowed_local_path: str | None = None  # None: local files refused


@dataclass(frozen=True)
class Fetched:
    data: bytes
    mime: str | None  # as declared: the data URL's type, the response's Content-Type; None: unknown


@dataclass
class FetchStats:
    """http(s) media URLs refused, by reason (address_policy.REFUSAL_REASONS)."""

    refused: dict[RefusalReason, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))


class MediaFetcher:
    def __init__(self, policy: FetchPolicy, client: httpx.AsyncClient | None = None,
                 resolve: Resolve = system_resolve):
        """`resolve`: host, port → its addresses (getaddrinfo by default; tests map names).
        `client` (default: the one made here) must follow no redirects and use no proxy, or
        the checks above would not hold for the connections it makes."""
        self.policy = policy
        self.stats = FetchStats()
        self._guard = AddressGuard(policy.allowed_networks, resolve)
        # No automatic redirects: each hop is checked here. Pinned connections (see above): no
        # idle connections kept, no proxy from the environment, its CA settings still read.
        self._client = client or httpx.AsyncClient(
            follow_redirects=False, timeout=httpx.Timeout(policy.timeout_s),
            headers={"User-Agent": "pagedserve-gateway"}, trust_env=False,
            verify=httpx.create_ssl_context(trust_env=True), limits=httpx.Limits(max_keepalive_connections=0))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def fetch(self, url: str, kind: MediaKind, param: str) -> Fetched:
        """The bytes behind `url`; every refusal is a 400 naming `param` (the part's url)."""
        if not url:
            raise invalid(f"The {kind} URL is empty.", param=param, code="invalid_media_url")
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(url, kind, param)
        if scheme in ("http", "https"):
            return await self._http(url, kind, param)
        if scheme in ("file", ""):
            return await self._local(url, kind, param)
        raise invalid(f"The {kind} URL has the unsupported scheme '{scheme}'; use data:, http(s):// "
                      "or (when the server allows local media) file://.", param=param,
                      code="invalid_media_url")

    # ---- data: ---------------------------------------------------------------------------

    def _data_url(self, url: str, kind: MediaKind, param: str) -> Fetched:
        header, comma, payload = url[len("data:"):].partition(",")
        if not comma:
            raise invalid(f"The {kind} data URL has no ',' before its data.", param=param,
                          code="invalid_media_url")
        mime, *attributes = header.split(";")
        mime = mime.strip().lower()
        if "base64" not in (a.strip().lower() for a in attributes):
            raise invalid(f"The {kind} data URL must be base64-encoded "
                          f"('data:{mime or kind + '/...'};base64,...').", param=param, code="invalid_base64")
        if mime != _GENERIC_MIME and not mime.startswith(f"{kind}/"):
            raise invalid(f"The {kind} data URL has media type '{mime or 'none'}'; expected {kind}/*.",
                          param=param, code="invalid_media_type")
        payload = "".join(payload.split())
        if len(payload) // 4 * 3 > self.policy.max_bytes + 2:
            raise _too_large(kind, f"about {len(payload) // 4 * 3}", self.policy.max_bytes, param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise invalid(f"The {kind} data URL's data is not valid base64.", param=param,
                          code="invalid_base64") from None
        if len(data) > self.policy.max_bytes:
            raise _too_large(kind, str(len(data)), self.policy.max_bytes, param)
        return Fetched(data, mime)

    # ---- http(s) ---------------------------------------------------------------------------

    async def _http(self, url: str, kind: MediaKind, param: str) -> Fetched:
        shown = _shown(url)
        try:
            async with asyncio.timeout(self.policy.timeout_s):
                try:
                    parsed = httpx.URL(url)
                except httpx.InvalidURL:
                    # A host httpx will not take ("0177.0.0.1": an invalid IPv4 address to it)
                    # may still spell an internal address to the resolver: refused alike.
                    await self._check_unparsed(url, kind, param)
                    raise
                return await self._follow(parsed, kind, param)
        except (TimeoutError, httpx.TimeoutException):
            raise _unreachable(kind, shown, f"no answer within {self.policy.timeout_s:g} s", param) from None
        except httpx.ConnectError as exc:
            raise _unreachable(kind, shown, f"could not connect ({exc})", param) from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _unreachable(kind, shown, str(exc) or type(exc).__name__, param) from None

    async def _follow(self, url: httpx.URL, kind: MediaKind, param: str) -> Fetched:
        for hop in range(MAX_REDIRECTS + 1):
            addresses = await self._check(url.host, url.raw_host.decode("ascii"),
                                          url.port or _DEFAULT_PORTS[url.scheme], kind, param, redirected=hop > 0)
            response = await self._send(url, addresses)
            try:
                if response.is_redirect and "location" in response.headers:
                    target = url.join(response.headers["location"])  # the name's URL: response.url is the IP's
                    if target.scheme not in ("http", "https"):
                        self._count("redirect")
                        raise invalid(f"Fetching the {kind} at {_shown(str(url))} was redirected "
                                      f"to a non-http(s) URL.", param=param, code="media_fetch_failed")
                    url = target
                    continue
                if response.status_code >= 400:
                    raise _unreachable(kind, _shown(str(url)), f"HTTP {response.status_code} "
                                       f"{response.reason_phrase}".rstrip(), param)
                return Fetched(await self._read_capped(response, kind, param),
                               response.headers.get("content-type", "").split(";")[0].strip().lower() or None)
            finally:
                await response.aclose()
        raise _unreachable(kind, _shown(str(url)), f"more than {MAX_REDIRECTS} redirects", param)

    async def _check(self, host: str, resolved_host: str, port: int, kind: MediaKind, param: str,
                     redirected: bool = False) -> tuple[IPAddress, ...]:
        """The addresses one hop may connect to: its host (`host` as shown, `resolved_host` as
        resolved: IDNA-encoded) must be an allowed domain, when the list is set, and resolve to
        allowed addresses only; a 400 otherwise."""
        allowed = self.policy.allowed_domains
        if allowed and host.lower() not in allowed:
            self._count("redirect" if redirected else "domain_not_allowed")
            raise invalid(f"{_hop(kind, host, redirected)} is not allowed: this server fetches media only "
                          f"from {', '.join(allowed)}.", param=param, code="media_domain_not_allowed")
        try:
            return await self._guard.check(resolved_host, port)
        except AddressRefused as refusal:
            self._count("redirect" if redirected else refusal.reason)
            raise _not_allowed(kind, host, redirected, param) from None

    async def _check_unparsed(self, url: str, kind: MediaKind, param: str) -> None:
        """`_check` for a URL httpx cannot parse, its host as urllib splits it (when it can)."""
        try:
            parts = urlsplit(url)
            host, port = parts.hostname, parts.port
        except ValueError:
            return
        if host:
            await self._check(host, host, port or _DEFAULT_PORTS[parts.scheme.lower()], kind, param)

    async def _send(self, url: httpx.URL, addresses: tuple[IPAddress, ...]) -> httpx.Response:
        """GET `url` (its head: the body is streamed) from the first of its checked addresses
        that takes the connection: the request goes to the address, with the name's Host header
        and TLS server name, so nothing resolves the name again."""
        for i, address in enumerate(addresses):
            request = self._client.build_request(
                "GET", url.copy_with(host=str(address)), headers={"Host": url.netloc.decode("ascii")},
                extensions={"sni_hostname": url.raw_host.decode("ascii")})
            try:
                return await self._client.send(request, stream=True)
            except httpx.ConnectError:
                if i == len(addresses) - 1:
                    raise
        raise AssertionError("AddressGuard.check returns at least one address")

    def _count(self, reason: RefusalReason) -> None:
        self.stats.refused[reason] += 1

    async def _read_capped(self, response: httpx.Response, kind: MediaKind, param: str) -> bytes:
        cap = self.policy.max_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise _too_large(kind, declared, cap, param)
        body = bytearray()
        async for chunk in response.aiter_bytes(_CHUNK_BYTES):
            body += chunk
            if len(body) > cap:
                raise _too_large(kind, f"more than {cap}", cap, param)
        return bytes(body)

    # ---- local files --------------------------------------------------------------------

    async def _local(self, url: str, kind: MediaKind, param: str) -> Fetched:
        allowed = self.policy.allowed_local_path
        if allowed is None:
            raise invalid(f"The {kind} URL names a local file, and this server reads no local files "
                          "(start it with --allowed-local-media-path to allow a folder).", param=param,
                          code="local_media_not_allowed")
        parts = urlsplit(url)
        if parts.scheme:  # file://[localhost]/abs/path
            if parts.netloc not in ("", "localhost"):
                raise invalid(f"The {kind} file URL names the host '{parts.netloc}'; only local files "
                              "(file:///path) can be read.", param=param, code="invalid_media_url")
            path = unquote(parts.path)
        else:
            path = url
        root = Path(allowed).resolve()
        try:
            target = (root / path).resolve()  # an absolute path replaces root; symlinks followed
        except (OSError, ValueError):  # a NUL byte, a symlink loop
            target = None
        if target is None or not target.is_relative_to(root):
            raise invalid(f"The {kind} file {path!r} is outside the folder this server may read "
                          "media from.", param=param, code="local_media_not_allowed")
        return Fetched(await asyncio.to_thread(self._read_file, target, kind, param), None)

    def _read_file(self, path: Path, kind: MediaKind, param: str) -> bytes:
        cap = self.policy.max_bytes
        try:
            with path.open("rb") as f:
                data = f.read(cap + 1)
        except FileNotFoundError:
            raise invalid(f"The {kind} file {path.name!r} does not exist.", param=param,
                          code="media_fetch_failed") from None
        except OSError as exc:  # a folder, no permission, ...
            raise invalid(f"The {kind} file {path.name!r} cannot be read: {exc.strerror or exc}.",
                          param=param, code="media_fetch_failed") from None
        if len(data) > cap:
            raise _too_large(kind, f"more than {cap}", cap, param)
        return data


def _shown(url: str, limit: int = 120) -> str:
    return url if len(url) <= limit else url[:limit] + "..."


def _too_large(kind: str, size: str, cap: int, param: str) -> OpenAIError:
    return invalid(f"The {kind} is {size} bytes; the limit is {cap} bytes.", param=param,
                   code="media_too_large")


def _not_allowed(kind: str, host: str, redirected: bool, param: str) -> OpenAIError:
    """The one answer for a host that resolves to an internal address or to none: it says
    nothing about what is there (open port or closed, image or not)."""
    return invalid(f"{_hop(kind, host, redirected)} does not resolve to a public address: media from "
                   f"addresses inside the server's network need {NETWORKS_FLAG}.", param=param,
                   code="media_url_not_allowed")


def _hop(kind: str, host: str, redirected: bool) -> str:
    """A refusal's subject: the URL's host, or the host a redirect led to."""
    return (f"The {kind} URL was redirected to the host '{host}', which" if redirected
            else f"The {kind} URL's host '{host}'")


def _unreachable(kind: str, url: str, why: str, param: str) -> OpenAIError:
    return invalid(f"The {kind} at {url} could not be fetched: {why}.", param=param,
                   code="media_fetch_failed")
