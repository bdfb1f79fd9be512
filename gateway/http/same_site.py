"""Whether a browser's request comes from this server's own pages (SPEC §9): the `Host`
it names (DNS rebinding sends a foreign name to 127.0.0.1), and the `Origin` and
`Sec-Fetch-Site` a browser adds to cross-site requests. A cookie goes with every request
the browser makes to this host, whichever page asks (another port of the same machine is
the same site), so a request it authorizes must pass these. Shared by the web chat API
and the admin API."""

from __future__ import annotations

from aiohttp import hdrs, web

from gateway.config.schema import LOOPBACK_HOSTS

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


def foreign_fetch_site(request: web.Request) -> str | None:
    """Why the browser says another site made this request (None when it does not)."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site.strip().lower() not in ("same-origin", "none"):
        return "cross-site requests are refused (Sec-Fetch-Site is not same-origin)"
    return None


def cross_site_problem(request: web.Request, http_host: str) -> str | None:
    """Why this request may come from another site (None when it cannot)."""
    refused = foreign_fetch_site(request)
    if refused is not None:
        return refused
    if http_host in LOOPBACK_HOSTS:
        # Only this machine can connect, so only its names are right: another name is a
        # site that rebound its DNS name to 127.0.0.1. (On other addresses the names are
        # a proxy's or the LAN's; the token and the Origin check guard those.)
        refused = foreign_host(request, server_names(http_host))
        if refused is not None:
            return refused
    return foreign_origin(request)
