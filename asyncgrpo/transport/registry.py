"""``open_transport(url)``: pick a transport by URL scheme.

Built in: ``file://`` and plain paths (:mod:`.local`), ``s3://`` (:mod:`.s3`), ``gs://``
(:mod:`.gcs`), ``az://``/``abfs[s]://``/``https://<account>.blob.core.windows.net`` (:mod:`.azure`),
``hf://buckets/`` (:mod:`.hf`). Other packages add schemes without touching asyncgrpo, through the entry point
group ``asyncgrpo.transports``: the entry point's name is the scheme and it loads a factory
``factory(url: str, **options) -> Transport``. :func:`register_scheme` does the same at runtime.

:func:`job_credentials` says, per scheme, what a job on another machine needs to open a URL
(:mod:`.credentials`): every launch backend asks it, so each accepts every object store here.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import urlsplit

from asyncgrpo.config.redaction import redact_text, redact_url
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport.base import Transport
from asyncgrpo.transport.credentials import (
    CredentialRule,
    JobCredentials,
    azure_credentials,
    gcs_credentials,
    hf_credentials,
    s3_credentials,
)

__all__ = [
    "ACCEPTED_FORMS",
    "TransportFactory",
    "check_transport_url",
    "is_local",
    "job_credentials",
    "open_transport",
    "register_scheme",
]

log = logging.getLogger(__name__)

TransportFactory = Callable[..., Transport]
ENTRY_POINT_GROUP = "asyncgrpo.transports"
ACCEPTED_FORMS = (
    "/abs/or/relative/path",
    "file:///abs/path",
    "s3://bucket[/prefix]",
    "gs://bucket[/prefix]",
    "az://container[/prefix]",
    "abfs[s]://container[@account.dfs.core.windows.net][/prefix]",
    "https://<account>.blob.core.windows.net/<container>[/prefix]",
    "hf://buckets/<namespace>/<bucket>[/prefix]",
)

_SCHEME_RE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
_registry: dict[str, TransportFactory] = {}
_credential_rules: dict[str, CredentialRule] = {}


def _local(url: str, **options: Any) -> Transport:
    from asyncgrpo.transport.local import LocalTransport

    return LocalTransport.from_url(url, **options)


def _s3(url: str, **options: Any) -> Transport:
    from asyncgrpo.transport.s3 import S3Transport

    return S3Transport.from_url(url, **options)


def _gcs(url: str, **options: Any) -> Transport:
    from asyncgrpo.transport.gcs import GCSTransport

    return GCSTransport.from_url(url, **options)


def _azure(url: str, **options: Any) -> Transport:
    from asyncgrpo.transport.azure import AzureBlobTransport

    return AzureBlobTransport.from_url(url, **options)


def _https(url: str, **options: Any) -> Transport:
    """Only Azure Blob account URLs: a plain web server is no object store."""
    host = (urlsplit(url).hostname or "").lower()
    if not host.endswith((".blob.core.windows.net", ".dfs.core.windows.net")):
        raise ConfigError(
            f"https:// transport URLs must be Azure Blob account URLs "
            f"(https://<account>.blob.core.windows.net/<container>[/prefix]), "
            f"got host {host!r}; accepted: {_forms()}"
        )
    return _azure(url, **options)


def _hf(url: str, **options: Any) -> Transport:
    from asyncgrpo.transport.hf import HFBucketTransport

    return HFBucketTransport.from_url(url, **options)


_BUILTIN: dict[str, TransportFactory] = {
    "file": _local,
    "s3": _s3,
    "gs": _gcs,
    "az": _azure,
    "abfs": _azure,
    "abfss": _azure,
    "https": _https,
    "hf": _hf,
}


#: What a job on another machine needs for each built-in object store (:mod:`.credentials`).
_BUILTIN_CREDENTIALS: dict[str, CredentialRule] = {
    "s3": s3_credentials,
    "gs": gcs_credentials,
    "az": azure_credentials,
    "abfs": azure_credentials,
    "abfss": azure_credentials,
    "https": azure_credentials,
    "hf": hf_credentials,
}


def register_scheme(
    scheme: str,
    factory: TransportFactory,
    *,
    replace: bool = False,
    credentials: CredentialRule | None = None,
) -> None:
    """Make ``open_transport`` hand URLs of ``scheme://`` to ``factory``; ``credentials``
    says what a launched job needs to open them (without it, jobs get nothing: a store that
    needs no credential, or one every job's machine already has)."""
    scheme = scheme.lower()
    if not replace and (scheme in _registry or scheme in _BUILTIN):
        raise ConfigError(f"transport scheme {scheme!r} is already registered; pass replace=True")
    _registry[scheme] = factory
    _credential_rules.pop(scheme, None)
    if credentials is not None:
        _credential_rules[scheme] = credentials


def _from_entry_points(scheme: str) -> TransportFactory | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name.lower() == scheme:
            log.debug("transport scheme %s from entry point %s", scheme, ep.value)
            factory = ep.load()
            _registry[scheme] = factory
            return factory
    return None


def _factory(url: str | Any) -> tuple[str, str | None, TransportFactory]:
    """``url`` as a string, its scheme (None for a plain path) and the factory that opens it;
    :class:`ConfigError` naming the accepted forms for an unknown scheme or a malformed URL."""
    if hasattr(url, "__fspath__"):
        url = str(url)
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(f"transport URL must be a non-empty string; accepted: {_forms()}")
    match = _SCHEME_RE.match(url)
    if match is None:
        if "://" in url or (":" in url.split("/", 1)[0] and not re.match(r"^[A-Za-z]:", url)):
            raise ConfigError(f"malformed transport URL {redact_text(url)!r}; accepted: {_forms()}")
        return url, None, _local
    scheme = match.group(1).lower()
    factory = _registry.get(scheme) or _BUILTIN.get(scheme) or _from_entry_points(scheme)
    if factory is None:
        raise ConfigError(
            f"unknown transport scheme {scheme!r} in {redact_text(url)!r}; accepted: {_forms()} "
            f"(or a scheme registered via entry point group {ENTRY_POINT_GROUP!r})"
        )
    return url, scheme, factory


def open_transport(url: str | Any, **options: Any) -> Transport:
    """Open the transport for ``url``; ``options`` go to its constructor as keywords.

    Raises :class:`ConfigError` naming the accepted forms for an unknown scheme or malformed URL.
    """
    url, _, factory = _factory(url)
    return factory(url, **options)


#: The extra that brings each built-in object store's client (obstore, huggingface_hub).
_EXTRAS = {"s3": "s3", "gs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure",
           "https": "azure", "hf": "hf"}  # fmt: skip


def check_transport_url(url: str | Any) -> None:
    """What can be known of ``url`` before any process starts, checked without a request: the
    scheme is one asyncgrpo opens, the URL has that scheme's form, and a credential the scheme
    cannot work without is there (``gs://``, ``az://``: their transports refuse to open without
    one). Nothing is created or contacted: a path is not made, a store is only configured.
    ``asyncgrpo train --dry-run``, ``python -m asyncgrpo.serve`` and ``asyncgrpo launch`` call
    it, so a typo fails in milliseconds, not after vLLM started."""
    url, scheme, factory = _factory(url)
    if scheme is None or scheme == "file" or factory is not _BUILTIN.get(scheme):
        return  # a path (made on first use), or another package's scheme: its own rules
    try:
        factory(url)
    except ImportError as exc:
        raise ConfigError(
            f"transport {scheme}:// needs the {_EXTRAS[scheme]!r} extra ({exc.name} is not "
            f"installed): pip install 'asyncgrpo[{_EXTRAS[scheme]}]'"
        ) from None


def is_local(url: str | Any) -> bool:
    """True for a directory (a path or ``file://``): storage only this host's processes share."""
    _, scheme, _ = _factory(url)
    return scheme is None or scheme == "file"


def job_credentials(url: str, environ: Mapping[str, str]) -> JobCredentials:
    """What a job on another machine needs to open ``url``, from the launcher's ``environ``:
    secrets, plain variables, and the names still missing. :class:`ConfigError` for a directory
    (jobs share no disk) or a scheme this process cannot open."""
    url, scheme, _ = _factory(url)
    if scheme is None or scheme == "file":
        raise ConfigError(
            f"transport_url={redact_url(url)!r}: jobs on other machines share no disk; use an "
            "object store: "
            + ", ".join(f for f in ACCEPTED_FORMS if "://" in f and "file" not in f)
        )
    rule = _credential_rules.get(scheme) or (
        _BUILTIN_CREDENTIALS.get(scheme) if scheme not in _registry else None
    )
    return rule(url, environ) if rule is not None else JobCredentials()


def _forms() -> str:
    extra = sorted(_registry)
    return ", ".join([*ACCEPTED_FORMS, *(f"{s}://..." for s in extra)])
