"""Credentials out of text: what a log line, an error, a repr or a metric may show.

Secrets reach text two ways: a config field marked secret (``metadata["secret"]``, handled by
:func:`asyncgrpo.config.settings.redacted`), and credentials inside an ordinary string, mostly URLs:
an Azure SAS token or a presigned S3/GCS URL in ``transport_url``, ``user:password@`` in an
upstream URL, ``AccountKey=`` in a connection string quoted by an error, a bearer token. This
module handles the second, for every string that leaves a process.

A URL keeps its scheme, host, path and the query parameters known to be harmless (an endpoint,
a region, a SAS token's version, permissions and expiry); every other query value, any
password or user token before ``@``, and the fragment become ``REDACTED``. An unknown parameter is
hidden rather than shown: a query may be a signature under a name this list does not know.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

__all__ = ["REDACTED", "has_credentials", "redact_text", "redact_url"]

REDACTED = "REDACTED"

#: Query parameters shown as they are: none of them grants access.
SAFE_QUERY_KEYS = frozenset(
    {
        "endpoint", "region", "config_format", "mode",
        # Azure SAS: version, services, resource types, permissions, start, expiry, protocol,
        # resource, policy id (the signature is ``sig``).
        "sv", "ss", "srt", "sp", "st", "se", "spr", "sr", "si",
        # presigned S3 / GCS URLs (the signature and credential are not in this list)
        "x-amz-algorithm", "x-amz-date", "x-amz-expires", "x-amz-signedheaders",
        "x-goog-algorithm", "x-goog-date", "x-goog-expires", "x-goog-signedheaders",
    }
)  # fmt: skip

_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# key=value credentials outside a URL (connection strings, headers quoted by an error)
_SECRET_PAIR = re.compile(
    r"(?i)\b(sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|"
    r"x-goog-signature|x-goog-credential|accountkey|sharedaccesssignature|password|passwd|"
    r"secret|client_secret|token|access_token|api_key|apikey)=[^&;\s\"'<>]+"
)
# a token: 8+ characters with a digit or symbol, so prose ("a bearer credential") stays
_BEARER = re.compile(r"(?i)\b(bearer)\s+(?=[A-Za-z]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]{8,}")


def _redact_query(query: str) -> str:
    out = []
    for item in query.split("&"):
        key, sep, value = item.partition("=")
        if not (sep or key):
            out.append(item)
        elif key.lower() in SAFE_QUERY_KEYS:  # an endpoint may carry credentials of its own
            out.append(f"{key}={redact_url(value)}" if "://" in value else item)
        else:
            out.append(f"{key}={REDACTED}" if sep else REDACTED)
    return "&".join(out)


def redact_url(url: str) -> str:
    """``url`` without credentials: userinfo secrets, unknown query values and the fragment
    become ``REDACTED``; a URL too malformed to split is hidden whole."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return REDACTED
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, sep, _ = userinfo.partition(":")
        netloc = f"{user}:{REDACTED}@{host}" if sep else f"{REDACTED}@{host}"
    query = _redact_query(parts.query) if parts.query else ""
    fragment = REDACTED if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def has_credentials(url: str) -> bool:
    """Whether :func:`redact_url` would hide part of ``url`` (so it must travel as a secret)."""
    return redact_url(url) != url


def redact_text(text: str) -> str:
    """``text`` with every URL redacted (:func:`redact_url`) and every ``key=value``
    credential and bearer token outside a URL replaced by ``REDACTED``."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _SECRET_PAIR.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    return _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)
