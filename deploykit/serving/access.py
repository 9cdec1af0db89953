"""What every request passes through, whatever its protocol: the bearer token, a request id, and
one JSON access line on stderr (what a log pipeline indexes without parsing free text)."""

from __future__ import annotations

import hmac
import json
import logging
import random
import re
import time

log = logging.getLogger("deploykit.serve.access")
#: A client's X-Request-ID echoed back and logged only when it is a plain token.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
UNAUTHORIZED = ("missing or wrong bearer token: send the header 'Authorization: Bearer <token>'"
                " (gRPC: the metadata 'authorization')")


def request_id(given: str | None) -> str:
    """The client's id when it is a plain token, else a new one (64 random bits: ids tell requests apart in
    the log, they guard nothing, so they need no system entropy, which costs a system call each)."""
    return given if given and REQUEST_ID.fullmatch(given) else f"{random.getrandbits(64):016x}"


def authorized(authorization: str | None, token: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <token>`` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def log_line(*, method: str, path: str, client: str | None, status: int, request: str, started: float,
             bytes_in: int, **extra) -> None:
    if not log.isEnabledFor(logging.INFO):
        return
    log.info(json.dumps({
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "request_id": request, "client": client, "method": method,
        "path": path, "status": status, "ms": round((time.perf_counter() - started) * 1e3, 3), "bytes_in": bytes_in,
        **extra,
    }))
