"""Replica-side adapter fetching: a transport URI in, a verified local directory out.

A vLLM replica on another machine cannot read the trainer's disk, and vLLM's own
``/v1/load_lora_adapter`` takes only a local directory (or a Hub model repo). So the trainer sends
a *reference* to a published version, ``<transport url>/<store prefix>/<name>/v<N>`` (for example
``s3://bucket/run1/adapters/run-1a2b/v3`` for the version vLLM serves as ``run-1a2b-v3``), and the
replica fetches it itself through :class:`~asyncgrpo.store.adapters.AdapterStore`: manifest last, every
size and sha256 checked, the directory appearing atomically.

Security: a caller of the proxy chooses the URI, so the replica fetches only from under the
transport roots it was started with (``ASYNCGRPO_ADAPTER_TRANSPORTS``), and it opens those roots
with its *own* settings and credentials. A URI is matched against the roots' canonical URLs
(``Transport.url``: no query, no credentials); a query in the URI (``?endpoint=``) is refused, so a
request can never redirect a replica to another server. Nothing is read before the check passes.

The cache holds only versions vLLM still serves: :meth:`AdapterFetcher.prune` drops the others.
Each replica process makes a new private cache directory (``mkdtemp``: mode 0700, a random
name, owner checked), so nobody else can plant files in it, and even there it trusts only the
versions this process fetched and verified itself (an in-memory record): a directory it finds
but did not verify is deleted and fetched again. A manifest, a file count or a total size beyond
the replica's :class:`~asyncgrpo.store.bundle.FetchLimits` is refused before any file is
fetched (``ASYNCGRPO_ADAPTER_MAX_*``).

This module knows nothing of vLLM; :mod:`asyncgrpo.serve.vllm_plugin` exposes it over HTTP.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio

from asyncgrpo.config.coerce import config_from_dict
from asyncgrpo.config.redaction import redact_text
from asyncgrpo.config.serve import CACHE_DIR_ENV, LIMITS_ENV_PREFIX, TRANSPORTS_ENV
from asyncgrpo.config.sources import env_overrides
from asyncgrpo.config.store import FetchLimits
from asyncgrpo.errors import ConfigError
from asyncgrpo.store.adapters import AdapterStore, check_adapter_name, parse_version
from asyncgrpo.transport import Transport, open_transport
from asyncgrpo.transport.base import check_key
from asyncgrpo.vllm.api import served_name

__all__ = [
    "CACHE_DIR_ENV",
    "LIMITS_ENV_PREFIX",
    "TRANSPORTS_ENV",
    "AdapterFetcher",
    "AdapterRef",
    "SourceForbidden",
    "adapter_uri",
    "limits_from_env",
    "parse_transports",
    "private_dir",
]

log = logging.getLogger(__name__)


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


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can reach: created with mode 0700 if missing; if
    it exists it must be a real directory (no link), owned by this user, closed to others."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"adapter cache {path} is not a directory (a link or a file)")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"adapter cache {path} belongs to uid {st.st_uid}, not this user "
            f"({os.geteuid()}): someone else could put files in it; use another directory"
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            f"adapter cache {path} has mode {stat.S_IMODE(st.st_mode):o}: other users could "
            "reach it; chmod 700 it or let the replica make its own"
        )
    return path


def _check_base(base: Path) -> None:
    """The parent of a replica's cache: ours or root's; writable by others only if sticky (as
    /tmp is), so nobody else can rename or replace our directory inside it."""
    st = os.stat(base)
    if st.st_uid not in (os.geteuid(), 0):
        raise ConfigError(
            f"{CACHE_DIR_ENV}={base} belongs to uid {st.st_uid}: use a directory of your own"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{CACHE_DIR_ENV}={base} is writable by other users and not sticky (mode "
            f"{stat.S_IMODE(st.st_mode):o}): they could swap the cache; use a private directory"
        )


def limits_from_env(environ: Mapping[str, str] | None = None) -> FetchLimits:
    """The replica's fetch limits: ``ASYNCGRPO_ADAPTER_MAX_*`` over :class:`FetchLimits`."""
    return config_from_dict(FetchLimits, env_overrides(FetchLimits, {}, LIMITS_ENV_PREFIX, environ))


class AdapterFetcher:
    """Resolve URIs against allowed roots, fetch verified versions, keep the cache bounded.

    ``cache_dir`` is created private (0700) or must already be: see :func:`private_dir`.
    """

    def __init__(
        self,
        roots: Iterable[str],
        cache_dir: str | os.PathLike[str],
        *,
        limits: FetchLimits | None = None,
    ) -> None:
        self._roots: dict[str, Transport] = {}
        for root in roots:
            try:
                transport = open_transport(root)
            except ConfigError as exc:
                raise ConfigError(
                    redact_text(f"{TRANSPORTS_ENV}: cannot open {root!r}: {exc}")
                ) from None
            self._roots[transport.url.rstrip("/")] = transport
        self.cache_dir = private_dir(Path(cache_dir).absolute())
        self.limits = limits or FetchLimits()
        self._loading: dict[Path, int] = {}  # fetched, vLLM not done loading: prune keeps them
        self._verified: set[Path] = set()  # what this process fetched and checked itself
        self._locks: dict[Path, anyio.Lock] = {}

    @classmethod
    def from_env(cls, port: int | None = None) -> AdapterFetcher:
        """The fetcher of a vLLM process: roots, cache base and limits from the environment.

        The cache is a new ``<base>/asyncgrpo-adapters-<port>-<random>`` (``mkdtemp``), removed
        at exit: two replicas on one host never share one, and nobody can prepare it in advance.
        """
        base = Path(os.environ.get(CACHE_DIR_ENV) or tempfile.gettempdir())
        base.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_base(base)
        tag = port if port is not None else os.getpid()
        cache = Path(tempfile.mkdtemp(prefix=f"asyncgrpo-adapters-{tag}-", dir=base))
        atexit.register(_remove_cache, cache)
        return cls(
            parse_transports(os.environ.get(TRANSPORTS_ENV)), cache, limits=limits_from_env()
        )

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
                f"lora_uri {redact_text(uri)!r} must be a plain URL (no query, fragment, "
                "backslash or control characters): the replica connects with its own settings"
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
                f"lora_uri {redact_text(uri)!r} is not under this replica's allowed transports "
                f"{self.roots}; add its root with --transport (or {TRANSPORTS_ENV})"
            )
        try:
            parts = check_key(rel).split("/")
        except ValueError as exc:
            raise SourceForbidden(f"lora_uri {uri!r}: {exc}") from None
        version = parse_version(parts[-1])
        if len(parts) < 2 or version is None:
            raise SourceForbidden(
                f"lora_uri {uri!r} must end in <adapter name>/v<N> (an AdapterStore version)"
            )
        try:
            name = check_adapter_name(parts[-2])
        except ConfigError as exc:
            raise SourceForbidden(f"lora_uri {uri!r}: {exc}") from None
        return AdapterRef(uri, root, "/".join(parts[:-2]), name, version)

    def _store(self, ref: AdapterRef) -> AdapterStore:
        return AdapterStore(self._roots[ref.root], prefix=ref.store_prefix, limits=self.limits)

    def _cache_for(self, ref: AdapterRef) -> Path:
        # One subdirectory per store: two runs may share an adapter name under different roots.
        digest = hashlib.sha256(f"{ref.root}/{ref.store_prefix}".encode()).hexdigest()[:16]
        return self.cache_dir / digest

    async def fetch(self, ref: AdapterRef) -> Path:
        """A verified local copy of ``ref`` (NotFound if unpublished, IntegrityError if bad or
        beyond the limits). A copy this process did not verify itself is fetched again."""
        store_dir = self._cache_for(ref)
        dest = (store_dir / served_name(ref.name, ref.version)).absolute()
        lock = self._locks.setdefault(dest, anyio.Lock())
        async with lock:
            if dest in self._verified and dest.is_dir():
                return dest
            self._verified.discard(dest)
            await anyio.to_thread.run_sync(private_dir, store_dir)
            await self._store(ref).fetch(ref.name, ref.version, store_dir, reuse=False)
            self._verified.add(dest)
            return dest

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
                if version_dir.resolve() in kept:
                    continue
                self._verified.discard(version_dir.absolute())  # never trusted again
                try:
                    shutil.rmtree(version_dir)
                except OSError as exc:
                    log.warning("adapter cache: cannot remove %s: %s", version_dir, exc)
                    continue
                removed.append(version_dir)
        if removed:
            log.info("adapter cache: removed %d version(s) vLLM no longer serves", len(removed))
        return removed

    def cached(self) -> list[Path]:
        """Versions in the cache that this process fetched and verified."""
        return sorted(p for p in self._verified if p.is_dir())

    async def aclose(self) -> None:
        for transport in self._roots.values():
            await transport.aclose()


def _remove_cache(cache: Path) -> None:
    """At exit: the cache is this process's alone; a failure is reported, not ignored."""
    try:
        shutil.rmtree(cache)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove the adapter cache %s: %s", cache, exc)
