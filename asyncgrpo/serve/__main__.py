"""``python -m asyncgrpo.serve --model DIR --replicas N``: run local vLLM replicas until interrupted.

Every ``ServeConfig`` field is a flag (``--help``) and an ``ASYNCGRPO_SERVE_<FIELD>``
environment variable; the API key only comes from the environment. Prints one line per replica
with its URL once every replica is healthy; SIGINT or SIGTERM stops all of them (whole process
trees).

``--register http://PROXY`` adds each replica, once healthy, to a running asyncgrpo proxy
(``POST /proxy/upstreams`` with the proxy's admin key, read from the environment variable
``--register-key-env`` names): a replacement for a lost replica, or more capacity. The proxy
loads the adapter versions it serves onto the replica before the replica takes requests. The
replicas stay joined: a proxy restarted by its supervisor (with its command line, which names
only the replicas it started with) has forgotten them, and each joins again within
``REJOIN_INTERVAL_S``. On SIGINT or SIGTERM the replicas leave the proxy before they stop.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from asyncgrpo.config.flags import parse_args
from asyncgrpo.config.paths import check_writable
from asyncgrpo.config.serve import ServeConfig
from asyncgrpo.console import parse_command_line, plain_help, run_async, run_command
from asyncgrpo.errors import ConfigError, ReplicaError, UsageError
from asyncgrpo.proxy.admin_client import ProxyClient, update_proxy
from asyncgrpo.serve.replicas import Replica, launch_replicas
from asyncgrpo.transport import check_transport_url

PROG = "python -m asyncgrpo.serve"
ENV_PREFIX = "ASYNCGRPO_SERVE_"
#: Where ``--register`` reads the proxy's admin key unless ``--register-key-env`` says.
REGISTER_KEY_ENV = "ASYNCGRPO_PROXY_ADMIN_API_KEY"
#: Seconds a replica that is stopping may take to leave the proxy.
LEAVE_TIMEOUT_S = 10.0
#: Seconds between two looks at whether the proxy still lists the replicas.
REJOIN_INTERVAL_S = 5.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Registration:
    """The proxy the replicas join, and its admin key (from the environment)."""

    proxy: str
    key: str | None = None

    def __repr__(self) -> str:
        return f"Registration(proxy={self.proxy!r})"


def _register_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--register",
        metavar="URL",
        help="Base URL of a running asyncgrpo proxy to add each replica to once it is healthy "
        "(and remove it from on exit). The replicas must be reachable from the proxy at "
        "their URL: set --host to an address it can reach.",
    )
    parser.add_argument(
        "--register-key-env",
        metavar="VAR",
        default=None,
        help="Environment variable holding the proxy's admin key (default "
        f"{REGISTER_KEY_ENV}); never given on the command line.",
    )


def parse(argv: Sequence[str] | None = None) -> ServeConfig:
    """The config; a bad value raises :class:`~asyncgrpo.errors.UsageError`."""
    return _parse(argv)[0]


def _parse(argv: Sequence[str] | None) -> tuple[ServeConfig, Registration | None, bool]:
    """The config, the proxy to register with, and ``--debug``."""
    config, args = parse_args(
        ServeConfig,
        argv,
        prog=PROG,
        description=plain_help(__doc__),
        env_prefix=ENV_PREFIX,
        extra=_register_flags,
    )
    if config.replicas < 1:
        raise UsageError(
            f"--replicas={config.replicas}: start 1 or more", prog=PROG, debug=args.debug
        )
    try:
        for url in config.transports:  # here, not 30 s later in every vLLM process
            check_transport_url(url)
    except ConfigError as exc:
        raise UsageError(f"--transport: {exc}", prog=PROG, debug=args.debug) from exc
    try:
        for flag, value in (
            ("--log-dir", config.log_dir),
            ("--adapter-cache-dir", config.adapter_cache_dir),
        ):
            if value is not None:  # a directory vLLM could not write fails it minutes later
                check_writable(Path(value), f"{flag} {value}")
    except ConfigError as exc:
        raise UsageError(str(exc), prog=PROG, debug=args.debug) from exc
    try:
        registration = _registration(config, args.register, args.register_key_env)
    except ConfigError as exc:
        raise UsageError(str(exc), prog=PROG, debug=args.debug) from exc
    return config, registration, args.debug


def _registration(
    config: ServeConfig, proxy: str | None, key_env: str | None
) -> Registration | None:
    if proxy is None:
        if key_env is not None:
            raise ConfigError("--register-key-env without --register: give the proxy's URL")
        return None
    if not proxy.startswith(("http://", "https://")):
        raise ConfigError(f"--register {proxy!r}: write the proxy's URL, http://HOST:PORT")
    if config.host in ("0.0.0.0", "::", ""):
        raise ConfigError(
            f"--register with --host {config.host!r}: the proxy would be told an address that is "
            "not one; bind the address the proxy reaches this host at"
        )
    key = os.environ.get(key_env or REGISTER_KEY_ENV) or None
    if key_env is not None and key is None:
        raise ConfigError(f"--register-key-env {key_env}: that variable is not set")
    return Registration(proxy.rstrip("/"), key)


async def _serve(config: ServeConfig, registration: Registration | None) -> None:
    async with launch_replicas(config) as replicas:
        for r in replicas:
            print(
                f"replica {r.index} ready: {r.url} (pid {r.pid}, log {r.log_path}, "
                f"{r.started_s:.1f} s)",
                flush=True,
            )
        if registration is None:
            await anyio.sleep_forever()
        try:
            await _join(registration, replicas, config.startup_timeout_s)
            await stay_joined(registration, replicas, config.startup_timeout_s)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(LEAVE_TIMEOUT_S):
                await _leave(registration, replicas)


async def _join(registration: Registration, replicas: Sequence[Replica], timeout_s: float) -> None:
    """Add every replica to the proxy; the proxy answers once each is up to date."""

    def on_retry(error: str) -> None:
        logger.warning(
            "the proxy at %s cannot take a replica yet (retrying): %s", registration.proxy, error
        )

    for r in replicas:
        if not await update_proxy(
            registration.proxy, registration.key, r.url, timeout_s=timeout_s, on_retry=on_retry
        ):
            raise ReplicaError(
                f"the proxy at {registration.proxy} did not take replica {r.index} ({r.url}) "
                f"within {timeout_s:.0f} s (serve.startup_timeout_s)"
            )
        print(f"replica {r.index} joined the proxy at {registration.proxy}", flush=True)


async def stay_joined(
    registration: Registration,
    replicas: Sequence[Replica],
    timeout_s: float,
    *,
    interval_s: float = REJOIN_INTERVAL_S,
) -> None:
    """Forever: every ``interval_s``, each replica the proxy no longer lists joins again (the
    proxy brings it up to date, as at its first join). A proxy that does not answer, restarting,
    is asked again at the next look; one that refuses the admin key for its list (a proxy with
    a client key) is sent the join itself, which it takes as done for a replica it has."""
    async with ProxyClient(registration.proxy, api_key=registration.key, timeout_s=10) as proxy:
        while True:
            await anyio.sleep(interval_s)
            try:
                listed = await proxy.proxy_upstreams()
            except ReplicaError:
                continue  # down or restarting: look again later
            except ConfigError:
                listed = None  # the list takes the client key: send the joins themselves
            missing = [r for r in replicas if listed is None or r.url not in listed]
            if listed is not None and missing:
                logger.warning(
                    "the proxy at %s no longer lists %s (restarted?); joining again",
                    registration.proxy,
                    ", ".join(r.url for r in missing),
                )
            for r in missing:
                try:
                    joined = await update_proxy(
                        registration.proxy, registration.key, r.url, timeout_s=timeout_s
                    )
                except ReplicaError as exc:
                    joined, error = False, str(exc)
                else:
                    error = f"not taken within {timeout_s:.0f} s"
                if not joined:
                    logger.warning(
                        "replica %d could not join %s again (%s); trying again",
                        r.index,
                        registration.proxy,
                        error,
                    )
                elif listed is not None:
                    print(
                        f"replica {r.index} joined the proxy at {registration.proxy} again",
                        flush=True,
                    )


async def _leave(registration: Registration, replicas: list[Replica]) -> None:
    for r in replicas:
        try:
            await update_proxy(
                registration.proxy, registration.key, r.url, remove=True, timeout_s=0
            )
        except (ConfigError, ReplicaError) as exc:
            logger.warning("replica %d could not leave the proxy: %s", r.index, exc)


def main(argv: Sequence[str] | None = None) -> None:
    config, registration, debug = parse_command_line(lambda: _parse(argv), PROG)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    run_command(lambda: _until_stopped(config, registration), PROG, debug=debug)


def _until_stopped(config: ServeConfig, registration: Registration | None) -> None:
    try:
        run_async(_serve, config, registration)
    except KeyboardInterrupt:
        pass  # SIGINT or SIGTERM is how a server is stopped: status 0


if __name__ == "__main__":
    main()
