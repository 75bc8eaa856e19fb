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

What an error (or any text that leaves a process: a log line, a dry run) may show: credentials
inside an ordinary string, mostly URLs (an Azure SAS token or a presigned S3/GCS URL in
``transport_url``, ``user:password@`` in an upstream URL, ``AccountKey=`` in a connection string
quoted by a library, a bearer token, an AWS access key id or a Hugging Face token quoted whole),
are hidden by :func:`redact_text`. It lives here, in the base layer, because every layer shows
text: the transports' and the proxy's errors, the launcher's dry run, the command line's error
lines (:mod:`asyncgrpo.console`); :mod:`asyncgrpo.config.redaction` adds configs' secret fields.
A URL keeps its scheme, host, path and the query parameters known to be harmless (an endpoint,
a region, a SAS token's version, permissions and expiry); every other query value, any password
or user token before ``@``, and the fragment become ``REDACTED``: a query may be a signature
under a name this list does not know. Text that merely looks like a URL (``s3://bucket[/prefix]``
in a list of accepted forms) keeps everything that is not userinfo, a query value or a fragment.
"""

from __future__ import annotations

import re

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


# -- what an error may show -----------------------------------------------------------------
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
    r"secret|password|passwd|api_key|apikey|account_key|accountkey|access_token|hf_token|"
    r"auth_token|sas_token)|sig|signature|x-amz-signature|x-amz-credential|"
    r"x-amz-security-token|x-goog-signature|x-goog-credential|sharedaccesssignature|token)(=|%3[dD])[^&;\s\"'<>]+"
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
