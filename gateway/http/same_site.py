"""Whether a browser request to a tokenless or local API comes from this server's own
pages (SPEC §9): the `Host` it names (DNS rebinding sends a foreign name to 127.0.0.1)
and the `Origin` a browser adds to cross-site requests. Shared by the web chat API and
the admin API."""

from __future__ import annotations

from aiohttp import hdrs, web

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def server_names(http_host: str) -> frozenset[str]:
    """The host names this server answers to: the configured one and loopback's."""
    configured = f"[{http_host}]" if ":" in http_host else http_host
    return frozenset(name.lower() for name in (configured, *LOOPBACK_NAMES))


def local_port(request: web.Request) -> int | None:
    """The port this connection came in on (the configured one may be 0: any free port)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return int(sockname[1]) if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def foreign_host(request: web.Request, names: frozenset[str]) -> str | None:
    """Why the `Host` header does not name this server (None when it does)."""
    host = request.headers.get(hdrs.HOST, "").strip().lower()
    port = local_port(request)
    allowed = {f"{name}:{port}" for name in names} | (set(names) if port == 80 else set())
    if host not in allowed:
        return f"the Host header must name this server (such as 127.0.0.1:{port}); other names are refused"
    return None


def foreign_origin(request: web.Request) -> str | None:
    """Why the `Origin` a browser sent is another site (None when absent or this server)."""
    origin = request.headers.get(hdrs.ORIGIN)
    host = request.headers.get(hdrs.HOST, "").strip().lower()
    if origin is not None and origin.strip().lower() not in (f"http://{host}", f"https://{host}"):
        return "cross-site requests are refused (Origin is not this server)"
    return None
