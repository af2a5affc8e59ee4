"""Who may use the gateway: bearer tokens, the websocket Origin allow-list, and per-address limits.

- Tokens: with `gateway.auth` on, the realtime websocket (and `/metrics` if asked) needs one of the configured
  director tokens, as `Authorization: Bearer <token>` or, for browsers that cannot set headers on a websocket,
  `?token=`. A session's watch websocket takes a viewer token or a director token; a viewer token on the realtime
  websocket is refused (403 `not_director`). Tokens are compared in constant time against every configured token
  and never logged.
- Origin: a browser's websocket handshake carries `Origin`; it must be the page's own origin, a loopback origin or
  one of `allowed_origins`, so another site cannot drive a session from a visitor's browser. Clients that send no
  Origin (CLIs, players, gRPC bridges) are not browsers and pass.
- Limits: at most `max_connections_per_address` open websockets and `starts_per_minute_per_address` session
  starts per client address; the books hold only addresses with open connections or recent starts.

Knows nothing about sessions or the pipeline: it answers "may this request go on" with a named refusal.
"""
from __future__ import annotations

import hmac
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.common.config import GatewayAuthConfig

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def load_tokens(config: GatewayAuthConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The configured director tokens (from `main()`: the file and the environment are read there only)."""
    tokens = _read_tokens(config.tokens_file, config.tokens_env, environ, "tokens")
    if config.enabled and not tokens:
        raise ValueError("gateway.auth is enabled but no token was found in its file or variable")
    return tokens


def load_viewer_tokens(config: GatewayAuthConfig, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The configured viewer tokens (none is fine: then only director tokens watch)."""
    return _read_tokens(config.viewer_tokens_file, config.viewer_tokens_env, environ, "viewer_tokens")


def _read_tokens(path: str, variable: str, environ: Mapping[str, str], name: str) -> tuple[str, ...]:
    tokens: list[str] = []
    if path:
        with open(path, encoding="utf-8") as f:
            tokens += [line.split("#", 1)[0].strip() for line in f]
    if variable:
        if variable not in environ:
            raise ValueError(f"gateway.auth.{name}_env names {variable}, which is not set")
        tokens += [t.strip() for t in environ[variable].split(",")]
    tokens = [t for t in tokens if t]
    short = [t for t in tokens if len(t) < 16]
    if short:
        raise ValueError(f"{len(short)} gateway {name.replace('_', ' ')} shorter than 16 characters: "
                         "use long random tokens")
    return tuple(tokens)


@dataclass(frozen=True)
class Refusal:
    """Why a request may not go on: the HTTP status, a named code and a message (which never holds a token)."""

    status: int
    code: str
    message: str


class Access:
    """The gateway's access checks (see the module docstring)."""

    def __init__(self, config: GatewayAuthConfig, tokens: Iterable[str] = (), clock=time.monotonic, *,
                 viewer_tokens: Iterable[str] = ()) -> None:
        self.config = config
        self._tokens = tuple(t.encode() for t in tokens)
        self._viewer_tokens = tuple(t.encode() for t in viewer_tokens)
        if config.enabled and not self._tokens:
            raise ValueError("gateway.auth is enabled without tokens")
        if set(self._tokens) & set(self._viewer_tokens):
            raise ValueError("a gateway token is both a director and a viewer token: give viewers their own")
        self._clock = clock
        self._open: dict[str, int] = {}
        self._starts: dict[str, deque[float]] = {}

    # -- tokens and origin --
    def check_token(self, headers: Mapping[str, str], query: Mapping[str, str], *,
                    watch: bool = False) -> Refusal | None:
        """None when auth is off or the request carries a director token (or, with `watch`, a viewer token)."""
        if not self.config.enabled:
            return None
        offered = query.get("token", "")
        header = headers.get("Authorization", "")
        if header:
            scheme, _, value = header.partition(" ")
            if scheme.lower() != "bearer" or not value.strip():
                return Refusal(401, "unauthorized", "the Authorization header must be 'Bearer <token>'")
            offered = value.strip()
        if not offered:
            return Refusal(401, "unauthorized", "a token is required: send 'Authorization: Bearer <token>' "
                                                "or add ?token=<token> to the URL")
        candidate = offered.encode()
        director, viewer = _matches(candidate, self._tokens), _matches(candidate, self._viewer_tokens)
        if director or (watch and viewer):
            return None
        if viewer:
            return Refusal(403, "not_director", "a viewer token can watch a session but not start one")
        return Refusal(401, "unauthorized", "the token is not valid")

    def check_origin(self, origin: str | None, host: str | None) -> Refusal | None:
        """None when the websocket's Origin is absent, the page's own, loopback or allowed."""
        if not origin:
            return None
        origin = origin.rstrip("/")
        parts = urlsplit(origin)
        if origin in self.config.allowed_origins or parts.hostname in LOOPBACK_HOSTS:
            return None
        if host and parts.netloc.lower() == host.lower():
            return None
        return Refusal(403, "origin_not_allowed", f"websocket connections from {origin} are not allowed: "
                                                  "add it to gateway.auth.allowed_origins")

    # -- per-address limits --
    def open_connection(self, address: str) -> Refusal | None:
        """Count one more open websocket of `address`, or refuse it (then nothing is counted)."""
        if self._open.get(address, 0) >= self.config.max_connections_per_address:
            return Refusal(429, "too_many_connections", f"at most {self.config.max_connections_per_address} "
                                                        "open connections per client address")
        self._open[address] = self._open.get(address, 0) + 1
        return None

    def close_connection(self, address: str) -> None:
        """Count one open websocket of `address` less."""
        left = self._open.get(address, 0) - 1
        if left > 0:
            self._open[address] = left
        else:
            self._open.pop(address, None)

    def allow_start(self, address: str) -> Refusal | None:
        """Count one `session.start` of `address`, or refuse it when the address is over its rate."""
        now = self._clock()
        starts = self._starts.setdefault(address, deque())
        while starts and now - starts[0] >= 60.0:
            starts.popleft()
        if len(starts) >= self.config.starts_per_minute_per_address:
            return Refusal(429, "rate_limited", f"at most {self.config.starts_per_minute_per_address} session "
                                                "starts per minute per client address; try again shortly")
        starts.append(now)
        self._forget_idle(now)
        return None

    def tracked_addresses(self) -> int:
        """Addresses the books hold now (open connections or starts in the last minute)."""
        return len(set(self._open) | set(self._starts))

    def _forget_idle(self, now: float) -> None:
        for address in [a for a, s in self._starts.items() if not s or now - s[-1] >= 60.0]:
            del self._starts[address]



def _matches(candidate: bytes, tokens: tuple[bytes, ...]) -> bool:
    matched = False
    for token in tokens:  # every token compared, in constant time each
        matched |= hmac.compare_digest(candidate, token)
    return matched
