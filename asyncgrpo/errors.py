"""One error tree for the whole library.

Third-party exceptions are translated at the edge (``raise ... from exc``), so callers catch
ours, or the builtin each one also is::

    AsyncGRPOError
    ├── ConfigError              (also ValueError)   a setting is wrong; the message names the fix
    │   ├── UsageError                               a command line is wrong (prog: which command)
    │   └── NoRoom                                   the proxy has no LoRA slots left for a run
    ├── TransportError                               storage failed
    │   ├── NotFound             (also FileNotFoundError)
    │   ├── AlreadyExists        (also FileExistsError)
    │   ├── InvalidKey           (also ValueError)   a key is absolute, empty or has '..'
    │   └── IntegrityError                           a checksum or manifest does not match
    ├── ReplicaError                                 a vLLM server misbehaved
    │   ├── ReplicaHTTPError                         it answered an error status (status, body)
    │   ├── ReplicaStartError                        it did not become healthy (log tail attached)
    │   └── NoHealthyReplica                         nothing left in rotation
    ├── SyncError                                    an adapter version did not reach every replica
    ├── AuditError                                   a replica served other weights than the trainer's
    ├── RankError                                    a data-parallel rank died or stopped answering
    ├── EpisodeError                                 an environment failed one group's episodes
    └── LaunchError                                  a launched job failed to start or died (log tail)

Task groups wrap what their tasks raise in exception groups; :func:`leaves` is the one place
that unwraps them (the command line reports each leaf, the rollout client re-raises one).
"""

from __future__ import annotations

#: Set to 1 to print the full traceback of any command's error (same as ``--debug``).
DEBUG_ENV = "ASYNCGRPO_DEBUG"
#: ``--debug``'s help, on every command.
DEBUG_HELP = f"on an error, print the full traceback too (or set {DEBUG_ENV}=1)"


class AsyncGRPOError(Exception):
    """Root of every error asyncgrpo raises on purpose."""


class ConfigError(AsyncGRPOError, ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


class NoRoom(ConfigError):
    """The proxy refused a run's LoRA-slot booking: the replicas' ``--max-loras`` are taken
    (or its table of runs is full). The message names the numbers."""


class UsageError(ConfigError):
    """A command line is wrong: argparse refused it, or a flag's value is invalid.

    Carries what the command's error line needs, since the parser that found it is not the
    code that reports it: ``prog``, the (sub)command whose parser found it (``asyncgrpo train``),
    and ``debug``, the line's ``--debug`` flag; None when argparse refused the line before reading
    it (argparse's own message is then all there is: no traceback is worth showing).
    """

    def __init__(self, message: str, *, prog: str, debug: bool | None = None) -> None:
        super().__init__(message)
        self.prog = prog
        self.debug = debug


class TransportError(AsyncGRPOError):
    """A storage operation failed."""


class EpisodeError(AsyncGRPOError):
    """An environment raised, hung past its timeout or returned a malformed episode: the
    rollout client drops that group (counted, logged once), the run goes on."""


class NotFound(TransportError, FileNotFoundError):
    """The key, version or checkpoint does not exist."""


class AlreadyExists(TransportError, FileExistsError):
    """A create-only write lost: the key already exists."""


class InvalidKey(TransportError, ValueError):
    """A storage key is empty, absolute or has ``.``/``..`` segments (would escape the root)."""


class IntegrityError(TransportError):
    """Downloaded bytes do not match their manifest (size or sha256)."""


class ReplicaError(AsyncGRPOError):
    """A vLLM replica failed or answered something unexpected."""


class ReplicaHTTPError(ReplicaError):
    """A replica (or the proxy) answered with an error status."""

    def __init__(self, message: str, *, url: str, status: int, body: str) -> None:
        super().__init__(message)
        self.url = url
        self.status = status
        self.body = body


class ReplicaStartError(ReplicaError):
    """A replica exited or timed out before becoming healthy."""


class NoHealthyReplica(ReplicaError):
    """No replica is in rotation."""


class SyncError(AsyncGRPOError):
    """An adapter version could not be loaded on every replica."""


class AuditError(AsyncGRPOError):
    """The served-policy audit found a replica whose logprobs are not the trainer's at the
    version it claims to serve; the message names the version, the replica and the gap."""


class RankError(AsyncGRPOError):
    """A collective of the data-parallel group failed: another rank died or timed out."""


class LaunchError(AsyncGRPOError):
    """A job of a launched run failed to start, became unhealthy or died; the message quotes
    its last log lines."""


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``'s (nested) exception groups, in order; ``[exc]`` for a
    plain exception."""
    if not isinstance(exc, BaseExceptionGroup):
        return [exc]
    return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
