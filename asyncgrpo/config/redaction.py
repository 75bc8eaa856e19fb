"""Credentials out of text and configs: what a log line, an error, a repr or a metric may show.

Secrets reach text two ways: a config field marked secret (``metadata["secret"]``: shown as
``REDACTED`` by :func:`redacted` and :func:`redacted_repr`), and credentials inside an ordinary
string, mostly URLs: an Azure SAS token or a presigned S3/GCS URL in ``transport_url``,
``user:password@`` in an upstream URL, ``AccountKey=`` in a connection string quoted by an error,
a bearer token, an AWS access key id or a Hugging Face token quoted whole
(:func:`redact_text`, for every string that leaves a process).

A URL keeps its scheme, host, path and the query parameters known to be harmless (an endpoint,
a region, a SAS token's version, permissions and expiry); every other query value, any
password or user token before ``@``, and the fragment become ``REDACTED``. An unknown parameter is
hidden rather than shown: a query may be a signature under a name this list does not know.
Only credentials are hidden: text that merely looks like a URL (``s3://bucket[/prefix]`` in a
list of accepted forms) keeps everything that is not userinfo, a query value or a fragment.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from asyncgrpo.config.coerce import to_dict
from asyncgrpo.config.fields import is_derived, is_secret

__all__ = ["REDACTED", "has_credentials", "redact_text", "redact_url", "redacted", "redacted_repr"]

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
# RFC 3986, appendix B: splits any string, so a URL-like one is never hidden whole
_URL_PARTS = re.compile(r"(([^:/?#]+):)?(//([^/?#]*))?([^?#]*)(\?([^#]*))?(#.*)?", re.DOTALL)
# key=value credentials outside a URL (connection strings, headers, environment variables quoted
# by an error): the name may carry a prefix (AWS_SECRET_ACCESS_KEY=, ASYNCGRPO_PROXY__API_KEY=);
# ``?``, ``&`` and ``=`` may be percent-encoded (``%3Fsig%3D...``: a URL quoted in another URL)
_SECRET_PAIR = re.compile(
    r"(?i)(?:\b|(?<=%3f)|(?<=%26))((?:[A-Za-z0-9]+_+)*(?:secret_access_key|session_token|"
    r"secret|password|passwd|api_key|apikey|account_key|accountkey|access_token|hf_token|auth_token|sas_token)|sig|"
    r"signature|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
    r"x-goog-credential|sharedaccesssignature|token)(=|%3[dD])[^&;\s\"'<>]+"
)
# credentials recognisable on their own: an AWS access key id, a Hugging Face token
_BARE = re.compile(r"\b(?:(?:AKIA|ASIA)[A-Z0-9]{16}|hf_[A-Za-z0-9]{30,})\b")
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
    become ``REDACTED``; the rest is kept as written, however malformed (split the RFC 3986
    way, which never fails, rather than validated: a bracket is no secret)."""
    match = _URL_PARTS.fullmatch(url)
    assert match is not None  # every part is optional: any string matches
    scheme, _, authority, netloc, path, query, query_text, fragment = match.groups()
    out = scheme or ""
    if authority is not None:
        if "@" in netloc:
            userinfo, _, host = netloc.rpartition("@")
            user, sep, _ = userinfo.partition(":")
            netloc = f"{user}:{REDACTED}@{host}" if sep else f"{REDACTED}@{host}"
        out += "//" + netloc
    out += path
    if query is not None:
        out += "?" + _redact_query(query_text)
    if fragment:
        out += "#" + REDACTED if fragment[1:] else fragment
    return out


def has_credentials(url: str) -> bool:
    """Whether :func:`redact_url` would hide part of ``url`` (so it must travel as a secret)."""
    return redact_url(url) != url


def redact_text(text: str) -> str:
    """``text`` with every URL redacted (:func:`redact_url`) and every ``key=value``
    credential and bearer token outside a URL replaced by ``REDACTED``."""
    text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    text = _SECRET_PAIR.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _BARE.sub(REDACTED, text)
    return _BEARER.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


def redacted(obj: Any, *, where: str = "") -> Any:
    """``to_dict(obj)`` fit to show: a set secret field is ``REDACTED``, every string has its
    URL credentials hidden. For trackio, logs and dry runs; not loadable back."""
    if not (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return to_dict(_shown(obj))
    out = {}
    for f in dataclasses.fields(obj):
        if is_derived(f, where):
            continue
        value = getattr(obj, f.name)
        hidden = is_secret(f) and value
        out[f.name] = REDACTED if hidden else redacted(value, where=f"{where}{f.name}.")
    return out


def redacted_repr(obj: Any) -> str:
    """A dataclass repr that shows no secret: assign it as ``__repr__ = redacted_repr`` in a
    config whose strings may carry credentials (the generated repr would print them)."""
    shown = []
    for f in dataclasses.fields(obj):
        if not f.repr:
            continue
        value = getattr(obj, f.name)
        if is_secret(f) and value:
            text = repr(REDACTED)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            text = redacted_repr(value)
        else:
            text = repr(_shown(value))
        shown.append(f"{f.name}={text}")
    return f"{type(obj).__name__}({', '.join(shown)})"


def _shown(value: Any) -> Any:
    """``value`` with URL credentials hidden in every string, containers kept as they are."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list | tuple):
        return type(value)(_shown(v) for v in value)
    if isinstance(value, dict):
        return {k: _shown(v) for k, v in value.items()}
    return value
