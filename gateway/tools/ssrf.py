"""The guard between a URL the model chose and the network (SPEC §5.2, §9).

The model's arguments are untrusted: a URL may name the gateway's own host, the LAN or a
cloud metadata service, directly or through a name or a redirect. So every hop's host is
resolved here, every address it resolves to is checked, and the connection then goes to
exactly those addresses (`PinnedResolver`): the HTTP client never looks the name up a
second time, so a DNS answer that changes between the check and the connect (rebinding)
cannot slip an unchecked address in. Host header, TLS SNI and certificate checks keep the
name from the URL.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

from aiohttp.abc import AbstractResolver

from gateway.tools.base import ToolError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

ALLOW_KEY = "tools.web_fetch.allow_private_networks"
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052: the IPv4 address is the last 32 bits


class Refused(ToolError):
    """The URL leads somewhere web_fetch may not go."""


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, in the resolver's order (the one lookup per hop;
    tests replace this function)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    seen: list[str] = []
    for _family, _type, _proto, _canon, sockaddr in infos:
        address = str(sockaddr[0]).split("%", 1)[0]  # an IPv6 zone ("fe80::1%eth0") is not part of the address
        if address not in seen:
            seen.append(address)
    return seen


def _kind(address: Address) -> str | None:
    """What makes `address` off limits, or None for a public address."""
    if address.is_unspecified:
        return "an unspecified"
    if address.is_loopback:
        return "a loopback"
    if address.is_link_local:
        return "a link-local"
    if address.is_multicast:
        return "a multicast"
    if address.is_private:
        return "a private"
    if address.is_reserved:
        return "a reserved"
    if not address.is_global:  # shared (carrier-grade NAT, 100.64.0.0/10) and other special ranges
        return "a non-public"
    return None


def address_problem(address: Address) -> str | None:
    """Why web_fetch may not connect to `address` (e.g. "a private address"), or None.
    IPv6 forms that carry an IPv4 address are judged by it: IPv4-mapped and NAT64 ones by
    it alone (they reach exactly that IPv4 host), 6to4 and Teredo by it and their own range."""
    if isinstance(address, ipaddress.IPv6Address):
        translated = address.ipv4_mapped
        form = "IPv4-mapped"
        if translated is None and address in _NAT64:
            translated, form = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF), "NAT64"
        if translated is not None:
            kind = _kind(translated)
            return None if kind is None else f"{kind} address ({form} {translated})"
        embedded: list[tuple[str, ipaddress.IPv4Address]] = []
        if address.sixtofour is not None:
            embedded.append(("6to4", address.sixtofour))
        if address.teredo is not None:
            server, client = address.teredo
            embedded += [("Teredo server", server), ("Teredo client", client)]
        for form, inner in embedded:
            kind = _kind(inner)
            if kind is not None:
                return f"{kind} address ({form} {inner})"
    kind = _kind(address)
    return None if kind is None else f"{kind} address"


def _parse(text: str) -> Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


async def checked_addresses(host: str, port: int, *, allow_private: bool) -> list[str]:
    """The addresses to connect to for `host`: every one it resolves to, each checked
    (all must pass: a name with one public and one private address is refused)."""
    literal = _parse(host)
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = await resolve_host(host, port)
        except (OSError, UnicodeError) as err:  # socket.gaierror is an OSError
            raise ToolError(f"cannot resolve {host!r}: {getattr(err, 'strerror', None) or err}") from None
        if not addresses:
            raise ToolError(f"cannot resolve {host!r}: no addresses")
    if allow_private:
        return addresses
    for text in addresses:
        address = _parse(text)
        problem = "an unparsable address" if address is None else address_problem(address)
        if problem is not None:
            where = text if literal is not None else f"{host} resolves to {text}, which"
            raise Refused(f"refused: {where} is {problem} ({ALLOW_KEY} is false)")
    return addresses


class PinnedResolver(AbstractResolver):
    """aiohttp's resolver for one fetch: answers only with the addresses the guard checked
    for each host, and refuses any host it was not told about (no lookup of its own)."""

    def __init__(self) -> None:
        self._pins: dict[str, list[str]] = {}

    def pin(self, host: str, addresses: list[str]) -> None:
        self._pins[host.rstrip(".").lower()] = list(addresses)

    async def resolve(self, host: str, port: int = 0,  # type: ignore[override]
                      family: socket.AddressFamily = socket.AF_UNSPEC) -> list[dict[str, Any]]:
        addresses = self._pins.get(host.rstrip(".").lower())
        if addresses is None:
            raise OSError(f"{host!r} was not checked by the web_fetch guard")
        out: list[dict[str, Any]] = []
        for text in addresses:
            fam = socket.AF_INET6 if ":" in text else socket.AF_INET
            if family not in (socket.AF_UNSPEC, 0) and fam != family:
                continue
            out.append({"hostname": host, "host": text, "port": port, "family": fam,
                        "proto": socket.IPPROTO_TCP, "flags": socket.AI_NUMERICHOST})
        if not out:
            raise OSError(f"no checked address of {host!r} in the requested family")
        return out

    async def close(self) -> None:
        self._pins.clear()
