"""Secrets out of text: passwords and tokens in URLs, bearer tokens, ``key=value`` credentials,
pydantic's ``input_value=...`` echo, and any exact value registered as secret (API keys loaded
from the settings). Used for log lines (:class:`RedactingFilter` on the root handlers), error
messages and settings dumps. Pure functions and one process-wide set of registered values.

    >>> redact("cannot connect to NATS at nats://user:hunter2@host:4222")
    'cannot connect to NATS at nats://user:***@host:4222'
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

MASK = "***"

# scheme://user:password@host  or  scheme://token@host
_URL_CRED = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^\s/@:'\"]*)(?::(?P<pw>[^\s/@'\"]*))?@")
_BEARER = re.compile(r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=:-]{4,}")
_KV = re.compile(
    r"(?i)((?:api[_-]?keys?|admin[_-]?key|access[_-]?token|auth[_-]?token|token|password|passwd|pwd|secret|"
    r"credentials?|authorization|x-api-key)[\"']?\s*[=:]\s*[\"']?)(?!\*\*\*)([^\s\"'&,;)\]}]+)")
_INPUT_VALUE = re.compile(r"input_value=(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\[[^\]]*\]|\{[^}]*\}|[^,\s]+)")
_SK = re.compile(r"\bsk-[A-Za-z0-9_-]{12,}")

_registered: set[str] = set()


def register(values: Iterable[str | None]) -> None:
    """Treat these exact strings as secrets wherever they appear (ignores empty and very short ones)."""
    for v in values:
        if v and len(v) >= 4:
            _registered.add(v)


def _url_sub(m: re.Match) -> str:
    user, pw = m.group("user"), m.group("pw")
    if pw is not None:
        return f"{m.group('scheme')}{user}:{MASK}@"
    return f"{m.group('scheme')}{MASK}@" if user else m.group(0)


def redact_url(url: str) -> str:
    """``scheme://user:pw@host`` -> ``scheme://user:***@host``; a token-only userinfo becomes ``***``;
    credential-looking query parameters are masked."""
    return _KV.sub(lambda m: m.group(1) + MASK, _URL_CRED.sub(_url_sub, url))


def redact(text: str) -> str:
    """Every secret pattern and registered value in ``text`` masked."""
    if not text:
        return text
    for v in _registered:
        if v in text:
            text = text.replace(v, MASK)
    text = _URL_CRED.sub(_url_sub, text)
    text = _BEARER.sub(lambda m: m.group(1) + m.group(2) + MASK, text)
    text = _KV.sub(lambda m: m.group(1) + MASK, text)
    text = _INPUT_VALUE.sub("input_value=" + MASK, text)
    return _SK.sub("sk-" + MASK, text)


def redact_obj(obj):
    """A JSON-like structure (a settings dump) with every string redacted."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_obj(v) for v in obj]
    return obj


class RedactingFilter(logging.Filter):
    """Redacts a record's formatted message and traceback before any handler writes it."""

    _fmt = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: leave it to the handler
            return True
        red = redact(msg)
        if red != msg:
            record.msg, record.args = red, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(self._fmt.formatException(record.exc_info))
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Put a :class:`RedactingFilter` on every handler of ``logger`` (the root by default); filters on
    handlers see the records propagated from every logger."""
    lg = logger or logging.getLogger()
    for h in lg.handlers:
        if not any(isinstance(f, RedactingFilter) for f in h.filters):
            h.addFilter(RedactingFilter())
