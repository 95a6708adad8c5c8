"""Where the direct fetcher may connect: public addresses only, unless configured otherwise.
Pure rules over an address (checked on the address actually connected to, after DNS) and over
a URL's host and port (literal IP hosts, in any spelling, before anything is resolved)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from yarl import URL

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_SHARED = ipaddress.IPv4Network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598)
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
# Never allowed by allow_private: cloud metadata (169.254.169.254, fd00:ec2::254 aside) lives on
# link-local addresses, and no page is served from a multicast, unspecified or reserved one.
NEVER = frozenset({"link-local", "multicast", "unspecified", "reserved"})
DEFAULT_PORTS = {"http": 80, "https": 443}


def _embedded(ip: ipaddress.IPv6Address) -> Iterable[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (mapped, 6to4, Teredo, NAT64), which a
    translating network would connect to."""
    if ip.ipv4_mapped is not None:
        yield ip.ipv4_mapped
    if ip.sixtofour is not None:
        yield ip.sixtofour
    if ip.teredo is not None:
        yield from ip.teredo
    if any(ip in net for net in _NAT64):
        yield ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)


def address_kind(ip: IPAddress) -> str | None:
    """What kind of non-public address `ip` is (None: a public one): loopback, private,
    link-local, shared (CGNAT), multicast, unspecified, reserved, or not globally routable."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.scope_id:
            return "link-local"
        for inner in _embedded(ip):
            kind = address_kind(inner)
            if kind is not None:
                return kind
    checks = (
        ("unspecified", ip.is_unspecified),
        ("loopback", ip.is_loopback),
        ("link-local", ip.is_link_local),
        ("multicast", ip.is_multicast),
        ("shared", ip in _SHARED),
        ("reserved", ip.is_reserved),
        ("private", ip.is_private),
        ("not globally routable", not ip.is_global),
    )
    return next((kind for kind, hit in checks if hit), None)


@dataclass(frozen=True)
class AddressRules:
    """Which addresses and ports the direct fetcher may connect to.

    - public addresses always; `allow_private` adds loopback, private (RFC 1918, fc00::/7),
      shared (CGNAT) and other non-global unicast, never link-local, multicast, unspecified or
      reserved; `allow_networks` are allowed whatever their kind (an intranet's one subnet);
    - `ports`: the URL ports allowed (empty: any).
    """

    allow_private: bool = False
    allow_networks: tuple[IPNetwork, ...] = ()
    ports: frozenset[int] = frozenset({80, 443})

    def refusal(self, address: str) -> str | None:
        """Why connecting to `address` (an IP, as DNS answered it) is refused; None: allowed."""
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return f"{address!r} is not an IP address"
        if any(ip in net for net in self.allow_networks):
            return None
        kind = address_kind(ip)
        if kind is None or (self.allow_private and kind not in NEVER):
            return None
        where = " (where cloud metadata services answer)" if kind == "link-local" else ""
        article = "an" if kind[0] in "aeiou" else "a"
        return f"{ip} is {article} {kind} address{where}, and only public ones are fetched"

    def url_refusal(self, url: URL) -> str | None:
        """Why the fetcher will not ask for `url` at all (None: it may resolve and connect): a
        scheme but http(s), a port not allowed, a literal IP host that is refused, or an IP
        written in a legacy spelling (`0x7f000001`, `2130706433`, `0177.0.0.1`, `127.1`)."""
        if url.scheme not in DEFAULT_PORTS or not url.raw_host:
            return f"{url.scheme or 'a relative'} URL: only http and https are fetched"
        if url.raw_user is not None or url.raw_password is not None:
            return "the URL carries credentials, and the proxy never sends any"
        port = url.port or DEFAULT_PORTS[url.scheme]
        if self.ports and port not in self.ports:
            allowed = ", ".join(str(p) for p in sorted(self.ports))
            return f"port {port} is not fetched (fetch_api.direct.ports: {allowed})"
        host = url.raw_host.rstrip(".")
        try:
            ipaddress.ip_address(host.partition("%")[0] if ":" in host else host)
        except ValueError:
            pass
        else:
            return self.refusal(host)
        legacy = _legacy_ipv4(host)
        if legacy is not None:
            return f"{host!r} spells the IP address {legacy} in a non-standard form"
        return None


def _legacy_ipv4(host: str) -> str | None:
    """The address a host spells the way inet_aton reads it (hex, octal, fewer than four
    parts, one number), or None for a name."""
    if not host or not all(c in "0123456789abcdefx." for c in host.lower()):
        return None
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """CIDR blocks (`10.1.2.0/24`, `fd00::/8`; a bare address is one host); ValueError names
    the one that is not."""
    return tuple(ipaddress.ip_network(v, strict=False) for v in values)
