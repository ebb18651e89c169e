"""Which addresses the gateway's media fetches may connect to: safe by default, opened only by
`--allowed-media-networks`.

A host is fetched from only when every address it resolves to is allowed: a public address
(global, in `ipaddress`'s sense, and not multicast, reserved, loopback, link-local,
unspecified, private or site-local), or any address inside one of the allowed networks.
So by default the gateway reaches nothing inside the network it runs in: loopback, RFC 1918,
ULA (fc00::/7), link-local (169.254/16: cloud metadata; fe80::/10), CGNAT (100.64/10),
multicast, unspecified (0.0.0.0 reaches this host) and reserved ranges are all refused.

Every spelling of an address is caught because the name is resolved here, with getaddrinfo,
as the connection would resolve it: `2130706433`, `0x7f.1`, `0177.0.0.1`, `127.1`,
`localhost` and names from /etc/hosts all come back as 127.0.0.1. An IPv6 address that
carries an IPv4 one is judged by the IPv4 address it reaches: IPv4-mapped (::ffff:a.b.c.d),
NAT64 (64:ff9b::/96: a public IPv4 address through DNS64 stays fetchable on an IPv6-only
network) and 6to4 (2002::/16). Anything else non-global (Teredo, 64:ff9b:1::/48, ...) is
refused as well.

Rebinding: `AddressGuard.check` resolves a name once and returns the addresses it checked;
the fetcher connects to one of those (gateway/media/fetch.py pins the connection: the URL's
host replaced by the address, the Host header and TLS server name kept as the name), so a
DNS answer that changes between the check and the connection changes nothing. The fetcher
checks every redirect hop the same way.

Stdlib only: gateway/config.py uses `networks_arg` as an argparse type.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# host, port → the addresses it resolves to, as text ("127.0.0.1", "::1", "fe80::1%eth0")
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]

# Why an http(s) media URL was refused (the gateway's pagedserve:mm_fetch_refused_total):
#   domain_not_allowed  the host is not in --allowed-media-domains
#   private_address     the host resolves to a non-public address outside --allowed-media-networks
#   unresolvable        the host resolves to no address
#   redirect            a redirect led to a refused host (any of the above) or to another scheme
RefusalReason = Literal["domain_not_allowed", "private_address", "unresolvable", "redirect"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = get_args(RefusalReason)

NETWORKS_FLAG = "--allowed-media-networks"
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: the IPv4 address in the last 32 bits
# Not globally reachable (IANA's special-purpose registries), though `is_global` says so on
# the Pythons before 3.12.4: IETF protocol assignments (DS-Lite, NAT64 discovery, ...).
_NOT_GLOBAL = (ipaddress.IPv4Network("192.0.0.0/24"),)


def parse_networks(text: str) -> tuple[IPNetwork, ...]:
    """`--allowed-media-networks`' value, comma-separated CIDRs ("10.0.0.0/8, fd00::/8"; a bare
    address is its /32 or /128) → the networks, without duplicates; ValueError names a bad one."""
    networks: list[IPNetwork] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ValueError(f"{NETWORKS_FLAG}: {item!r} is not a network in CIDR notation such as "
                             f"192.168.10.0/24 or fd00::/8 ({exc})") from None
    return tuple(dict.fromkeys(networks))


def networks_arg(text: str) -> str:
    """argparse type of --allowed-media-networks: the text, once it parses."""
    try:
        parse_networks(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def reached_address(address: IPAddress) -> IPAddress:
    """The address a connection to `address` reaches: the IPv4 address inside an IPv4-mapped,
    NAT64 or 6to4 IPv6 address; `address` itself otherwise."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in _NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def is_public(address: IPAddress) -> bool:
    """Whether `address` reaches the public internet: global, and none of the special ranges
    that `is_global` alone lets through (multicast, for one)."""
    reached = reached_address(address)
    return reached.is_global and not (
        reached.is_multicast or reached.is_private or reached.is_reserved or reached.is_loopback
        or reached.is_link_local or reached.is_unspecified
        or (isinstance(reached, ipaddress.IPv6Address) and reached.is_site_local)
        or any(reached in network for network in _NOT_GLOBAL))


async def system_resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, as a connection would get them (getaddrinfo, off the
    event loop)."""
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for *_, sockaddr in found]


class AddressRefused(Exception):
    """A host the guard refuses: `reason` is "private_address" or "unresolvable"."""

    def __init__(self, host: str, reason: RefusalReason):
        super().__init__(f"{host}: {reason}")
        self.host = host
        self.reason = reason


@dataclass(frozen=True)
class AddressGuard:
    """Resolves a host once and checks every address it resolves to."""

    allowed_networks: tuple[IPNetwork, ...] = ()  # non-public addresses that may be reached
    resolve: Resolve = system_resolve

    def allows(self, address: IPAddress) -> bool:
        """A public address, or one (or the IPv4 address it reaches) inside an allowed network."""
        if is_public(address):
            return True
        candidates = {address, reached_address(address)}
        return any(a in network for a in candidates for network in self.allowed_networks)

    async def check(self, host: str, port: int) -> tuple[IPAddress, ...]:
        """The addresses of `host` (a name or an IP literal, as the URL spells it), in the
        resolver's order, when every one is allowed; AddressRefused otherwise."""
        try:
            found = await self.resolve(host, port)
        except (OSError, UnicodeError, ValueError):  # gaierror is an OSError; a bad IDNA label
            raise AddressRefused(host, "unresolvable") from None
        addresses: list[IPAddress] = []
        for text in found:
            try:
                address = ipaddress.ip_address(text)
            except ValueError:
                raise AddressRefused(host, "unresolvable") from None
            if not self.allows(address):
                raise AddressRefused(host, "private_address")
            addresses.append(address)
        if not addresses:
            raise AddressRefused(host, "unresolvable")
        return tuple(dict.fromkeys(addresses))
