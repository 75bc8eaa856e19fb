"""What every HTTP server asyncgrpo runs holds its clients to where the rule is the same: the
proxy's front and the Tinker service's (which imports it from here). How many connections fit
this process's open-file limit, and which ``Host`` a server that listens on loopback answers (a
guard against DNS rebinding: a web page whose name resolves to 127.0.0.1 sends its own name as
``Host``). Pure, but for :func:`raise_open_files`.
"""

from __future__ import annotations

import logging

from asyncgrpo.config.serve import is_loopback

__all__ = ["connection_cap", "host_is_local", "raise_open_files"]

log = logging.getLogger(__name__)

#: Descriptors left to the rest of the process (a trainer opens model shards, logs, datasets).
RESERVED_FILES = 512


def raise_open_files() -> int:
    """Raise this process's soft limit on open files to its hard limit (each request in flight
    holds two sockets; the default soft limit is often 1024); returns the soft limit now."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on POSIX
        return 1 << 16
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, exc)
        return soft
    return want


def connection_cap(requested: int, what: str = "max_connections") -> int:
    """``requested`` client connections, lowered (with a warning) so that they and the
    process's other descriptors fit the open-file limit: at the cap a server closes idle
    connections or refuses new ones instead of failing ``accept`` with EMFILE."""
    files = raise_open_files()
    cap = min(requested, max(64, (files - RESERVED_FILES) // 2))
    if cap < requested:
        log.warning("%s lowered to %d to fit the open-file limit %d", what, cap, files)
    return cap


def host_is_local(value: str) -> bool:
    """Whether a ``Host`` header value names a loopback address (``localhost``, 127.x,
    ``[::1]``), with or without a port."""
    host = value.lower()
    if host.startswith("["):
        host = host[1 : host.find("]")]
    elif ":" in host:
        host = host.rpartition(":")[0]
    return is_loopback(host)
