"""Ray addresses: the host and port of ``RayPrep(address=...)``, IPv6 included.

A host name or IPv4 address takes its port after a colon (``10.0.0.5:6379``); an IPv6 address,
whose own colons make a bare ``host:port`` ambiguous, takes it after brackets (``[::1]:6379``),
as in URLs and as Ray writes it. A bare IPv6 address (``fe80::1``, ``[::1]``) and a host without
a port mean Ray's default port, :data:`DEFAULT_PORT` (``ray start --head``'s).
"""

from __future__ import annotations

import ipaddress

__all__ = ["DEFAULT_PORT", "join", "split"]

DEFAULT_PORT = 6379


def split(address: str) -> tuple[str, int]:
    """``(host, port)`` of a head's address (see the module's docstring); an IPv6 host without
    brackets.

    Raises:
        ValueError: no host, an unclosed bracket, a bracketed host that is not an IPv6 address,
            or a port that is not a number from 1 to 65535.
    """
    text = address.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{address!r}: an IPv6 address is written '[<address>]:<port>', e.g. '[::1]:6379'")
        if not _ipv6(host):
            raise ValueError(f"{address!r}: {host!r} in brackets is not an IPv6 address")
        port = rest[1:] if rest else str(DEFAULT_PORT)
    elif text.count(":") > 1:  # an IPv6 address without brackets: it holds no port
        if not _ipv6(text):
            raise ValueError(
                f"{address!r} is neither 'host:port' nor an IPv6 address (with a port: '[<address>]:<port>')"
            )
        host, port = text, str(DEFAULT_PORT)
    else:
        host, sep, port = text.partition(":")
        port = port if sep else str(DEFAULT_PORT)
    if not host:
        raise ValueError(f"{address!r} names no host: give '<head>:<port>', e.g. '10.0.0.5:6379'")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: the port {port!r} is not a number from 1 to 65535")
    return host, int(port)


def join(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets: what :func:`split` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)  # a scope ("fe80::1%eth0") included
    except ValueError:
        return False
    return True
