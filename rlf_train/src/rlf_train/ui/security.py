"""Who may use the web UI: the checks that come first on every request (see `rlf_train.ui.app`'s docstring).

- A loopback bind answers only requests whose Host is its own address (DNS rebinding: a page on another site that
  resolves its name to 127.0.0.1 still sends its own Host).
- With a token (required off loopback), every request, page and files included, carries it: the `X-RLF-Token`
  header or the cookie the printed `?token=` link sets (HttpOnly, SameSite=Strict); compared in constant time.
- A request that changes anything carries `X-RLF-UI: 1` (another site's page cannot send it without a CORS
  preflight, which is never granted) and, if it has an Origin, the app's own.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

COOKIE = "rlf_ui_token"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Guarded(Protocol):
    """What the guard needs of the app."""

    port: int

    @property
    def host(self) -> str: ...

    @property
    def token(self) -> str | None: ...

    def seen(self, page: str | None) -> None: ...


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False



def allowed_hosts(host: str, port: int) -> set[str]:
    names = {host, "127.0.0.1", "localhost", "[::1]"} if is_loopback(host) else set()
    return {f"{n}:{port}" for n in names} | (names if port == 80 else set())


def token_ok(token: str | None, given: str | None) -> bool:
    if token is None:
        return True
    return given is not None and hmac.compare_digest(given.encode("utf-8"), token.encode("utf-8"))


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _secure(headers: Any) -> None:
    headers.setdefault("X-Content-Type-Options", "nosniff")
    headers.setdefault("Referrer-Policy", "no-referrer")
    headers.setdefault("Cache-Control", "no-store")


def make_guard(ui: Guarded) -> Any:
    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if is_loopback(ui.host) and request.host not in allowed_hosts(ui.host, ui.port):
            return web.Response(status=421, text="rlf ui: unexpected Host header (open the app at the address it "
                                                 "printed)")
        token = ui.token
        if token is not None:
            given = request.headers.get("X-RLF-Token") or request.cookies.get(COOKIE)
            if not token_ok(token, given):
                query_token = request.query.get("token")
                if query_token is not None and token_ok(token, query_token) and request.method == "GET":
                    # the printed link: keep the token in a cookie, drop it from the address bar
                    resp = web.HTTPFound(request.rel_url.with_query(
                        {k: v for k, v in request.query.items() if k != "token"}).human_repr())
                    resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", path="/")
                    raise resp
                return web.Response(status=401, text="rlf ui: this app needs its token: open the link it printed "
                                                     "(…/?token=…), or send the X-RLF-Token header")
        if request.method not in ("GET", "HEAD"):
            origin = request.headers.get("Origin")
            if request.headers.get("X-RLF-UI") != "1" or (
                    origin is not None and origin not in (f"http://{request.host}", f"https://{request.host}")):
                return error_response(403, "requests that change anything must come from the app's own page")
        ui.seen(request.headers.get("X-RLF-Page"))
        try:
            resp = await handler(request)
        except web.HTTPException as e:
            _secure(e.headers)
            raise
        _secure(resp.headers)
        return resp

    return guard
