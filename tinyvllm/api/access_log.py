"""The access log holds no secret: query parameters that may carry one are written as `***`.

    GET /v1/models?api_key=sk-abc&limit=2   ->   GET /v1/models?api_key=***&limit=2

Taught in docs/phases/09-appendix-server-defects.md.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, quote

SECRET_NAME = re.compile(r"key|token|secret|passw|auth|signature|credential", re.IGNORECASE)


def redact_query(target: str) -> str:
    """A request target (path and query) with the values of secret-looking query parameters replaced by ***."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    fields = parse_qsl(query, keep_blank_values=True)
    if not any(SECRET_NAME.search(name) for name, _ in fields):
        return target
    pairs = [(name, "***" if SECRET_NAME.search(name) else quote(value, safe="")) for name, value in fields]
    return path + "?" + "&".join(f"{quote(name, safe='')}={value}" for name, value in pairs)


class RedactQuerySecrets(logging.Filter):
    """On uvicorn's access logger, whose record args are (client, method, target, ...)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], redact_query(args[2]), *args[3:])
        return True


def install() -> None:
    """Put the filter on uvicorn's access logger (once; uvicorn's logging setup keeps a logger's filters)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQuerySecrets) for f in logger.filters):
        logger.addFilter(RedactQuerySecrets())
