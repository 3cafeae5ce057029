"""Access control: API keys (`--api-key`) and the paths a runtime adapter load may read (`--lora-root`).

With keys set, every route needs `Authorization: Bearer KEY` (one of the keys) except the open ones
vLLM leaves open to probes and scrapers: /health, /ping, /metrics, /version, /load (and CORS preflights).
Deny by default: a route added later is protected without being listed here. The key check hashes
both sides and compares the digests in constant time, against every key, so neither the key's
length nor which key matched shows in the timing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from moelora.server.protocol import ApiError, error_body

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def route_path(scope) -> str:
    """The path the app routes on: uvicorn puts its `--root-path` in front of every request's path (the ASGI
    spec's form), so a probe behind a path-stripping proxy arrives as e.g. /api/health."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


class ApiKeyMiddleware:
    """ASGI middleware (pure, so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_keys: tuple[str, ...], on_refused=None):
        self.app, self._digests, self._on_refused = app, tuple(_digest(k) for k in api_keys), on_refused

    def authorized(self, header: bytes | None) -> bool:
        scheme, _, token = (header or b"").partition(b" ")
        given = _digest(token.strip())
        ok = False
        for digest in self._digests:  # no early exit
            ok |= hmac.compare_digest(given, digest)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or route_path(scope) in OPEN_PATHS
                or self.authorized(dict(scope["headers"]).get(b"authorization"))):
            await self.app(scope, receive, send)
            return
        if self._on_refused is not None:
            self._on_refused()
        body = json.dumps(error_body(401, "Unauthorized: a valid API key is required (Authorization: Bearer "
                                          "KEY)")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def check_lora_path(lora_path: str, roots: tuple[str, ...]) -> str:
    """The path to load: `lora_path` itself without roots; with roots, its resolved form (symlinks and `..`
    resolved: the loader reads what was checked), 403 unless it and every file directly in it lie inside
    one of `roots`."""
    if not roots:
        return lora_path
    resolved = [Path(r).resolve() for r in roots]
    target = Path(lora_path).resolve()

    def inside(p: Path) -> bool:
        return any(p == r or p.is_relative_to(r) for r in resolved)

    outside = [] if inside(target) else [target]
    if not outside and target.is_dir():
        outside = [f.resolve() for f in target.iterdir() if not inside(f.resolve())]
    if outside:
        raise ApiError(403, f"lora_path {lora_path!r} resolves to {str(outside[0])!r}, outside the allowed "
                            f"--lora-root directories ({', '.join(map(str, resolved))})", "lora_path")
    return str(target)
