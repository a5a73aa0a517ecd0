"""The Alertmanager webhook's bearer token: where it comes from and how a request is checked against it.

The token is a shared secret between Alertmanager (`http_config.authorization`, type Bearer) and the
operator. It comes from `--webhook-token-file PATH` (the chart mounts a Secret there; the file is
re-read when it changes, so a rotated Secret takes effect without a restart) or from the
`SITS_WEBHOOK_TOKEN` variable. Requests are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger("sits.operator.webhook")

TOKEN_ENV = "SITS_WEBHOOK_TOKEN"
MIN_TOKEN_CHARS = 16  # a guessable shared secret is none: `openssl rand -hex 32` gives 64
# Visible ASCII: what an HTTP header carries unchanged
_TOKEN_CHARS = frozenset(chr(code) for code in range(0x21, 0x7F))


class WebhookTokenError(ValueError):
    """The configured token is missing, unreadable or unusable; the message says which and why."""


def _validated(token: str, origin: str) -> bytes:
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise WebhookTokenError(f"the webhook token from {origin} has {len(token)} characters; "
                                f"at least {MIN_TOKEN_CHARS} are needed (e.g. `openssl rand -hex 32`)")
    if not set(token) <= _TOKEN_CHARS:
        raise WebhookTokenError(f"the webhook token from {origin} must be visible ASCII (no spaces or control "
                                "characters), as an HTTP header carries it")
    return token.encode("ascii")


class BearerToken:
    """The token requests must present as `Authorization: Bearer <token>`.

    Built from a literal (`SITS_WEBHOOK_TOKEN`) or a file; a file is checked on every request and
    re-read when its modification time or inode changes (Kubernetes swaps a mounted Secret's files
    atomically). If a re-read fails, the last good token stays in force and a warning is logged.
    """

    def __init__(self, *, token: str | None = None, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._path: Path | None = None
        if token is not None and path is None:
            self._token = _validated(token, f"${TOKEN_ENV}")
        elif path is not None and token is None:
            self._path = Path(path)
            self._token = self._read(self._path)
        else:
            raise WebhookTokenError("give the webhook token either literally or as a file, not both")

    def _read(self, path: Path) -> bytes:
        try:
            stat = path.stat()
            token = _validated(path.read_text(encoding="utf-8", errors="strict"), str(path))
        except (OSError, UnicodeDecodeError) as error:
            raise WebhookTokenError(f"cannot read the webhook token file {path}: {error}") from error
        self._stamp = (stat.st_mtime_ns, stat.st_ino)
        return token

    def _current(self) -> bytes:
        if self._path is None:
            return self._token
        with self._lock:
            try:
                stat = self._path.stat()
                if (stat.st_mtime_ns, stat.st_ino) != self._stamp:
                    self._token = self._read(self._path)
                    logger.info("webhook token reloaded from %s", self._path)
            except (OSError, WebhookTokenError) as error:
                logger.warning("webhook token file %s unusable, keeping the previous token: %s", self._path, error)
            return self._token

    def accepts(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries this token (scheme `Bearer`, any case)."""
        scheme, _, credentials = (authorization or "").strip().partition(" ")
        presented = credentials.strip().encode("utf-8", errors="replace")
        # compare_digest even for a wrong scheme, so the time taken says nothing about the header
        return hmac.compare_digest(presented, self._current()) and scheme.lower() == "bearer"


def token_from(token_file: str | None, token: str | None) -> BearerToken | None:
    """The configured token: `--webhook-token-file` or `$SITS_WEBHOOK_TOKEN` (None when neither is set).

    Raises WebhookTokenError when both are set, or the one given cannot be used.
    """
    if token_file and token:
        raise WebhookTokenError(f"give --webhook-token-file or ${TOKEN_ENV}, not both")
    if token_file:
        return BearerToken(path=token_file)
    if token:
        return BearerToken(token=token)
    return None
