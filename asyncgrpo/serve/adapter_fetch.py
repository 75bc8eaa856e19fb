"""Replica-side adapter fetching: a transport URI in, a verified local directory out.

A vLLM replica on another machine cannot read the trainer's disk, and vLLM's own
``/v1/load_lora_adapter`` takes only a local directory (or a Hub model repo). So the trainer sends
a *reference* to a published version, ``<transport url>/<store prefix>/<name>/v<N>`` (for example
``s3://bucket/run1/adapters/run-1a2b/v3`` for the version vLLM serves as ``run-1a2b-v3``), and the
replica fetches it itself through :class:`~asyncgrpo.adapters.AdapterStore`: manifest last, every
size and sha256 checked, the directory appearing atomically.

Security: a caller of the proxy chooses the URI, so the replica fetches only from under the
transport roots it was started with (``ASYNCGRPO_ADAPTER_TRANSPORTS``), and it opens those roots
with its *own* settings and credentials. A URI is matched against the roots' canonical URLs
(``Transport.url``: no query, no credentials); a query in the URI (``?endpoint=``) is refused, so a
request can never redirect a replica to another server. Nothing is read before the check passes.

The cache holds only versions vLLM still serves: :meth:`AdapterFetcher.prune` drops the others,
and a (re)started replica starts with an empty cache directory of its own.

This module knows nothing of vLLM; :mod:`asyncgrpo.serve.vllm_plugin` exposes it over HTTP.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.adapters import AdapterStore
from asyncgrpo.errors import ConfigError
from asyncgrpo.transport import Transport, open_transport
from asyncgrpo.transport.base import check_key

__all__ = [
    "CACHE_DIR_ENV",
    "TRANSPORTS_ENV",
    "AdapterFetcher",
    "AdapterRef",
    "SourceForbidden",
    "adapter_uri",
    "parse_transports",
]

log = logging.getLogger(__name__)

#: Transport roots a replica may fetch adapters from (comma-separated URLs or paths).
TRANSPORTS_ENV = "ASYNCGRPO_ADAPTER_TRANSPORTS"
#: Directory under which the replica keeps its adapter cache (default: the system temp dir).
CACHE_DIR_ENV = "ASYNCGRPO_ADAPTER_CACHE_DIR"

_VERSION_RE = re.compile(r"^v(\d+)$")


class SourceForbidden(ConfigError):
    """The URI is malformed or not under a transport root this replica allows."""


def adapter_uri(transport_url: str, store_prefix: str, name: str, version: int) -> str:
    """The reference the trainer sends for one published version (see the module docstring)."""
    return "/".join(p.strip("/") for p in (transport_url, store_prefix, name, f"v{version}") if p)


def parse_transports(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """Allowed roots from the environment variable's comma-separated form (or a list)."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    return tuple(item.strip() for item in items if item and item.strip())


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A version resolved against an allowed root: which store, which name, which version."""

    uri: str
    root: str  #: canonical URL of the allowed root it is under
    store_prefix: str  #: key prefix of the adapter store under that root
    name: str
    version: int


class AdapterFetcher:
    """Resolve URIs against allowed roots, fetch verified versions, keep the cache bounded."""

    def __init__(self, roots: Iterable[str], cache_dir: str | os.PathLike[str]) -> None:
        self._roots: dict[str, Transport] = {}
        for root in roots:
            try:
                transport = open_transport(root)
            except ConfigError as exc:
                raise ConfigError(f"{TRANSPORTS_ENV}: cannot open {root!r}: {exc}") from exc
            self._roots[transport.url.rstrip("/")] = transport
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._loading: dict[Path, int] = {}  # fetched, vLLM not done loading: prune keeps them

    @classmethod
    def from_env(cls, port: int | None = None) -> AdapterFetcher:
        """The fetcher of a vLLM process: roots and cache from the environment.

        The cache is ``<base>/asyncgrpo-adapters-<port>``, emptied at start: two replicas on one
        host never share it, and a restarted replica reuses nothing it did not verify itself.
        """
        base = Path(os.environ.get(CACHE_DIR_ENV) or tempfile.gettempdir())
        cache = base / f"asyncgrpo-adapters-{port if port is not None else os.getpid()}"
        shutil.rmtree(cache, ignore_errors=True)
        return cls(parse_transports(os.environ.get(TRANSPORTS_ENV)), cache)

    @property
    def roots(self) -> list[str]:
        """Canonical URLs of the allowed roots (no credentials, no query: safe to show)."""
        return sorted(self._roots)

    def resolve(self, uri: object) -> AdapterRef:
        """Check ``uri`` against the allowed roots; :class:`SourceForbidden` says why not."""
        if not isinstance(uri, str) or not uri:
            raise SourceForbidden("lora_uri must be a non-empty string")
        if any(c in uri for c in "?#\\\x00") or any(ord(c) < 0x20 for c in uri):
            raise SourceForbidden(
                f"lora_uri {uri!r} must be a plain URL (no query, fragment, backslash or control "
                "characters): the replica connects with its own settings"
            )
        if not self._roots:
            raise SourceForbidden(
                f"this replica fetches adapters from no transport; start it with --transport URL "
                f"(python -m asyncgrpo.serve) or {TRANSPORTS_ENV}=URL"
            )
        for root in self._roots:
            if uri.startswith(root + "/"):
                rel = uri[len(root) + 1 :]
                break
        else:
            raise SourceForbidden(
                f"lora_uri {uri!r} is not under this replica's allowed transports {self.roots}; "
                f"add its root with --transport (or {TRANSPORTS_ENV})"
            )
        try:
            parts = check_key(rel).split("/")
        except ValueError as exc:
            raise SourceForbidden(f"lora_uri {uri!r}: {exc}") from None
        match = _VERSION_RE.match(parts[-1])
        if len(parts) < 2 or match is None:
            raise SourceForbidden(
                f"lora_uri {uri!r} must end in <adapter name>/v<N> (an AdapterStore version)"
            )
        return AdapterRef(uri, root, "/".join(parts[:-2]), parts[-2], int(match.group(1)))

    def _store(self, ref: AdapterRef) -> AdapterStore:
        return AdapterStore(self._roots[ref.root], prefix=ref.store_prefix)

    def _cache_for(self, ref: AdapterRef) -> Path:
        # One subdirectory per store: two runs may share an adapter name under different roots.
        digest = hashlib.sha256(f"{ref.root}/{ref.store_prefix}".encode()).hexdigest()[:16]
        return self.cache_dir / digest

    async def fetch(self, ref: AdapterRef) -> Path:
        """A verified local copy of ``ref`` (NotFound if unpublished, IntegrityError if bad)."""
        return await self._store(ref).fetch(ref.name, ref.version, self._cache_for(ref))

    @contextlib.contextmanager
    def loading(self, path: Path) -> Iterator[Path]:
        """Keep ``path`` out of :meth:`prune` while vLLM loads it (another load may prune)."""
        key = path.resolve()
        self._loading[key] = self._loading.get(key, 0) + 1
        try:
            yield path
        finally:
            self._loading[key] -= 1
            if not self._loading[key]:
                del self._loading[key]

    def prune(self, keep: Iterable[str | os.PathLike[str]]) -> list[Path]:
        """Delete cached versions whose directory is not in ``keep`` (what vLLM still serves)
        and that no load in progress is reading."""
        kept = {Path(p).resolve() for p in keep} | set(self._loading)
        removed = []
        for store_dir in self.cache_dir.iterdir() if self.cache_dir.is_dir() else ():
            for version_dir in store_dir.iterdir() if store_dir.is_dir() else ():
                if version_dir.name.startswith("."):
                    continue  # a fetch in progress (temp dirs are hidden)
                if version_dir.resolve() not in kept:
                    shutil.rmtree(version_dir, ignore_errors=True)
                    removed.append(version_dir)
        if removed:
            log.info("adapter cache: removed %d version(s) vLLM no longer serves", len(removed))
        return removed

    def cached(self) -> list[Path]:
        """Verified versions in the cache."""
        if not self.cache_dir.is_dir():
            return []
        return sorted(
            v
            for s in self.cache_dir.iterdir()
            if s.is_dir()
            for v in s.iterdir()
            if not v.name.startswith(".")
        )

    async def aclose(self) -> None:
        for transport in self._roots.values():
            await transport.aclose()
