"""Who may drive the server: every request's Host, Origin, fetch metadata and token checked before any route runs.

A web page the user visits can reach 127.0.0.1 too. What stops it:
- a Host allowlist (DNS rebinding: a page whose name is rebound to 127.0.0.1 sends its own name as Host):
  127.0.0.1, localhost and [::1], `--host`, and the address the connection arrived on, each with the server's port;
- Origin, where a browser sends one, must be the server's own (`http://` + the request's Host): a cross-origin POST
  or DELETE is refused whatever its content type (the job route takes only application/json on top of this);
- Sec-Fetch-Site cross-site or same-site is refused except for a GET navigation (a link to the page): another
  origin cannot embed a result (<video src>) or send a no-cors request; Cross-Origin-Resource-Policy says the same to
  browsers that send no fetch metadata;
- a token, where the server has one (`--allow-remote` requires it): `Authorization: Bearer <token>` on every request
  but the page itself, which holds no job data. A header, never a cookie: nothing a browser attaches on its own, so
  a page that does not know the token cannot use the server. The page takes it from its URL's fragment
  (`/#token=...`: never sent to the server, not in its log), keeps it in the tab's sessionStorage and sends it as
  the header.
No CORS header is ever sent: a browser lets no other origin read an answer.

Guard is a plain ASGI middleware (nothing of the request is read before it has decided); check() is the decision.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
from typing import Iterable

__all__ = ["Guard", "check", "check_token", "LOOPBACK_NAMES", "TOKEN_ENV", "MIN_TOKEN_CHARS"]

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
TOKEN_ENV = "CHUNKFLOW_SERVE_TOKEN"
MIN_TOKEN_CHARS = 16
_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")  # RFC 6750's b64token: fits the header and a URL fragment as it is
_HOST = re.compile(r"(\[[0-9a-fA-F:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?")
_SAFE = ("GET", "HEAD")
_HEADERS = [(b"cross-origin-resource-policy", b"same-origin"), (b"x-content-type-options", b"nosniff"),
            (b"referrer-policy", b"no-referrer")]


def check_token(token: str, where: str = TOKEN_ENV) -> str:
    """`token` if it is one a server may use (at least MIN_TOKEN_CHARS of RFC 6750's token characters); else
    ValueError saying what to give."""
    if len(token) < MIN_TOKEN_CHARS or _TOKEN.fullmatch(token) is None:
        raise ValueError(f"{where} must be at least {MIN_TOKEN_CHARS} characters of A-Z a-z 0-9 - . _ ~ + / (then "
                         "any '='), such as the output of: "
                         "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


def host_name(host: str) -> str:
    """An address or name as it appears in a Host header: lowercased, an IPv6 address in brackets."""
    host = host.strip().lower()
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _parse_host(value: str) -> tuple[str, int] | None:
    m = _HOST.fullmatch(value.strip().lower())
    if m is None:
        return None
    return m.group(1), int(m.group(2)) if m.group(2) else 80


def check(method: str, path: str, headers: dict[str, str], local: tuple[str, int] | None, names: frozenset[str],
          token: str | None) -> tuple[int, str] | None:
    """Why this request is refused, as (status, one-line reason), or None if it may go on. `headers`: lowercased
    names, each given once; `local`: the (address, port) the connection arrived on; `names`: the Host names allowed
    besides the loopback ones."""
    host = headers.get("host")
    parsed = _parse_host(host) if host is not None else None
    if parsed is None:
        return 400, "the request has no valid Host header"
    name, port = parsed
    allowed = set(names) | set(LOOPBACK_NAMES)
    if local is not None:
        allowed.add(host_name(str(local[0])))
    if name not in allowed or (local is not None and local[1] is not None and port != local[1]):
        return 403, (f"this server answers to {', '.join(sorted(allowed))} on its own port, not Host {host!r} "
                     "(a page's name rebound to this address is refused)")
    origin = headers.get("origin")
    if origin is not None and origin.lower() != f"http://{host.strip().lower()}":
        return 403, f"Origin {origin!r} is not this server's (http://{host}): another site's page may not use it"
    site = headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site") and not (
            method in _SAFE and headers.get("sec-fetch-mode") == "navigate"
            and headers.get("sec-fetch-dest", "document") == "document"):
        return 403, f"a {site} request: only this server's own page may use it"
    if token is not None and not (method in _SAFE and path == "/"):
        auth = headers.get("authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            return 401, ("this server needs its token: send Authorization: Bearer <token> (in a browser, open "
                         f"http://{host}/#token=<token>)")
    return None


class Guard:
    """ASGI middleware: check() on every HTTP request before the app sees it (a refusal is a JSON error), and
    Cross-Origin-Resource-Policy, nosniff and no-referrer on every answer."""

    def __init__(self, app, names: Iterable[str] = (), token: str | None = None) -> None:
        self.app = app
        self.names = frozenset(host_name(n) for n in names if not _unspecified(n))  # 0.0.0.0 is no one's name
        self.token = token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers: dict[str, str] = {}
        repeated = False
        for k, v in scope.get("headers", []):
            key = k.decode("latin-1").lower()
            repeated |= key in headers and key in ("host", "origin", "authorization")
            headers[key] = v.decode("latin-1")
        local = scope.get("server")
        refusal = (400, "a Host, Origin or Authorization header given twice") if repeated else check(
            scope["method"], scope["path"], headers, tuple(local) if local else None, self.names, self.token)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + _HEADERS
            await send(message)

        if refusal is None:
            return await self.app(scope, receive, send_with_headers)
        status, reason = refusal
        body = json.dumps({"error": reason}).encode()
        extra = [(b"www-authenticate", b'Bearer realm="chunkflow serve"')] if status == 401 else []
        await send_with_headers({"type": "http.response.start", "status": status,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(body)).encode())] + extra})
        await send_with_headers({"type": "http.response.body", "body": body})
