"""``http_get``: a GET of the daemon's HTTP endpoints (``/healthz``, ``/metrics``) for tests."""

from __future__ import annotations

import urllib.error
import urllib.request


def http_get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    """Status and decoded body of a GET of ``url``, HTTP errors included (a 503 is an answer);
    raises :class:`urllib.error.URLError` when nothing answers within ``timeout_s`` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
