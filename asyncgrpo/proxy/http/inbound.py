"""What the front accepts from a client, on top of llhttp's own strictness (pure: no I/O).

A request llhttp accepted is still refused here for its version, method, target (a path
only), transfer coding, size and number of fields (trailers included), Host, key, expectation, and for what only a web page in the user's browser would send (an
``Origin``, a body that is not JSON, a Host that is not this machine's on a loopback proxy: a
``text/plain`` POST needs no CORS preflight). The list: ``docs/proxy.md``, "Security".
"""

from __future__ import annotations

import hmac

import httptools

from asyncgrpo.config.proxy import ProxyConfig, is_loopback
from asyncgrpo.proxy.http.headers import DROP_REQUEST_B, RUN_HEADER, SESSION_HEADER
from asyncgrpo.proxy.http.policy import host_is_local

__all__ = [
    "ADMIN_PATHS",
    "HEAD_LIMIT",
    "MAX_FIELDS",
    "PIECE_BYTES",
    "RUNS_PATH",
    "TOO_LARGE",
    "Refused",
    "Request",
    "Rules",
    "check_head",
    "check_trailer",
    "refusal",
]

#: Longest request head (request line and headers), trailers of a chunked body included.
HEAD_LIMIT = 64 * 1024
#: Most header fields in a request, trailers included: each costs a Python call and a tuple.
MAX_FIELDS = 256
#: Body pieces smaller than this are joined as they arrive (:meth:`Request.add`).
PIECE_BYTES = 64 * 1024
TOO_LARGE = f"request head over {HEAD_LIMIT} bytes"
TOO_MANY = f"more than {MAX_FIELDS} header fields"
#: Routes that change the replica set (but for reading it: GET, HEAD): the admin key, not the
#: client key. Reading the list stays with the client key, as ``/proxy/stats`` shows it too.
ADMIN_PATHS = frozenset({b"/proxy/upstreams"})
#: The book of runs: its writes take the admin key when one is set (else the client key).
RUNS_PATH = b"/proxy/runs"
_READ = frozenset({b"GET", b"HEAD"})
_SESSION = SESSION_HEADER.lower().encode()
_RUN = RUN_HEADER.lower().encode()
_WATCH = frozenset({b"origin", b"content-type", _SESSION, _RUN})
_ADMIN_OFF = (
    "admin routes are off: give the proxy an admin key (export ASYNCGRPO_PROXY_ADMIN_API_KEY, or "
    "--admin-api-key-env VAR; in a run's config proxy.admin_api_key) and send it as "
    "'Authorization: Bearer <admin key>'"
)


class Refused(Exception):
    """The request is refused: answer ``status`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Rules:
    """What :func:`check_head` needs from the settings, computed once."""

    __slots__ = ("admin", "auth", "hosts", "loopback", "max_body")

    def __init__(self, config: ProxyConfig) -> None:
        self.max_body = config.max_body_bytes
        self.auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        self.admin = f"Bearer {config.admin_api_key}".encode() if config.admin_api_key else None
        self.loopback = is_loopback(config.host)
        self.hosts: set[bytes] = set()  # Host values found to name this machine

    def local_host(self, value: bytes) -> bool:
        """Whether a Host header names a loopback address (``localhost``, 127.x, ``[::1]``)."""
        if value in self.hosts:
            return True
        if not host_is_local(value.decode("latin-1")):
            return False
        if len(self.hosts) < 64:
            self.hosts.add(value)
        return True


class Request:
    """One request as llhttp hands it over: head, then body piece by piece."""

    __slots__ = (
        "auth",
        "body",
        "content_type",
        "expect",
        "fields",
        "head_size",
        "headers",
        "host",
        "hosts",
        "http11",
        "keep_alive",
        "length",
        "lines",
        "method",
        "origin",
        "run",
        "session",
        "size",
        "target",
        "te",
    )

    def __init__(self) -> None:
        self.method = self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []  # as llhttp accepted them
        self.lines: list[bytes] = []  # "Name: value\r\n" of those a replica may see
        self.hosts = self.size = 0
        self.head_size = self.fields = 0  # the head's, then the trailers' added (check_trailer)
        self.te: list[bytes] = []
        self.auth = self.expect = self.host = self.origin = self.content_type = None
        self.session: int | None = None  # hash of X-Session-ID: a fixed size whatever its length
        self.run: str | None = None  # X-Asyncgrpo-Run: the run it counts for, if not its model's
        self.length: int | None = None
        self.http11 = self.keep_alive = True
        #: the body as it came, small pieces joined (:meth:`add`): ``size`` bytes in all
        self.body: list[bytes | bytearray] = []

    def add(self, data: bytes) -> None:
        """A piece of the body: kept as it came when it is large, else joined to the small
        piece before it, so that what the body holds is its size. llhttp hands over a chunked
        body chunk by chunk: kept one object per chunk, a body in 1-byte chunks cost the proxy
        about 100 bytes per byte (a 2 MB body grew it by 196 MB), and handing millions of pieces
        on stalled the event loop for seconds. Joined, a body holds at most one
        object per :data:`PIECE_BYTES`; a body that comes in one piece is never copied."""
        body = self.body
        if body and len(data) < PIECE_BYTES and len(last := body[-1]) < PIECE_BYTES:
            if isinstance(last, bytes):  # a second small piece: start growing a copy
                last = body[-1] = bytearray(last)
            last += data
            if len(last) >= PIECE_BYTES:  # full: exactly its size (a bytearray grows ahead)
                body[-1] = bytes(last)
        else:
            body.append(data)

    def scan_headers(self) -> int:
        """Read what the rules need from the headers, and keep the forwardable ones as lines;
        returns the size of the head."""
        lines = self.lines
        size = len(self.target)
        for name, value in self.headers:
            size += len(name) + len(value) + 4
            lower = name.lower()
            if lower not in DROP_REQUEST_B:
                lines.append(b"%s: %s\r\n" % (name, value))
                if lower in _WATCH:
                    if lower == b"origin":
                        self.origin = value
                    elif lower == _SESSION:
                        self.session = hash(value)
                    elif lower == _RUN:
                        self.run = value.decode("latin-1")
                    else:
                        self.content_type = value
            elif lower == b"host":
                self.hosts += 1
                self.host = value
            elif lower == b"content-length":
                self.length = int(value)  # llhttp checked the digits, and that there is one
            elif lower == b"transfer-encoding":
                self.te.append(value)
            elif lower == b"authorization":
                self.auth = value
            elif lower == b"expect":
                self.expect = value.lower()
        self.head_size, self.fields = size, len(self.headers)
        return size


def _json(value: bytes) -> bool:
    media = value.partition(b";")[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


def check_head(req: Request, version: str, rules: Rules) -> None:
    """Raise :class:`Refused` if the front does not take a request with this head."""
    if req.scan_headers() > HEAD_LIMIT:
        raise Refused(431, TOO_LARGE)
    if req.fields > MAX_FIELDS:
        raise Refused(431, TOO_MANY)
    if version not in ("1.1", "1.0"):
        raise Refused(505, f"HTTP/{version} is not supported: only HTTP/1.0 and 1.1")
    req.http11 = version == "1.1"
    if req.method == b"CONNECT":
        raise Refused(405, "CONNECT is not supported: this is not a forward proxy")
    if req.target[:1] != b"/":  # absolute form (http://host/...), authority form, asterisk
        raise Refused(
            400,
            "the request target must be a path (origin form, /...): this is not a forward proxy",
        )
    if req.te:
        if not req.http11:
            raise Refused(400, "Transfer-Encoding in an HTTP/1.0 request")
        if [c.strip().lower() for v in req.te for c in v.split(b",")] != [b"chunked"]:
            te = b", ".join(req.te).decode("latin-1")
            raise Refused(501, f"Transfer-Encoding {te!r} is not supported: only chunked")
    if req.length is not None and req.length > rules.max_body:
        raise Refused(413, f"request body too large: {req.length} bytes > {rules.max_body}")
    if req.hosts > 1 or (req.http11 and not req.hosts):
        raise Refused(400, "a request needs exactly one Host header (RFC 9112 3.2)")
    if req.origin is not None:
        raise Refused(403, "requests from web pages (an Origin header) are refused")
    host = req.host
    if (
        rules.loopback
        and host is not None
        and host not in rules.hosts
        and not rules.local_host(host)
    ):
        raise Refused(
            403,
            "this proxy listens on loopback and answers only Host localhost or a loopback "
            "address (a guard against DNS rebinding)",
        )
    path = req.target.partition(b"?")[0]
    admin = req.method not in _READ and (
        path in ADMIN_PATHS or (path == RUNS_PATH and rules.admin is not None)
    )
    if admin:
        if rules.admin is None:
            raise Refused(403, _ADMIN_OFF)
        if not hmac.compare_digest(req.auth or b"", rules.admin):
            raise Refused(401, "missing or wrong 'Authorization: Bearer <admin key>'")
    elif rules.auth is not None and not hmac.compare_digest(req.auth or b"", rules.auth):
        raise Refused(401, "missing or wrong 'Authorization: Bearer <key>'")
    if req.expect not in (None, b"100-continue"):
        raise Refused(417, f"unsupported Expect {req.expect!r}: only 100-continue")
    ct = req.content_type
    if ct is not None and ct != b"application/json" and (req.te or req.length) and not _json(ct):
        raise Refused(
            415, f"Content-Type {ct.decode('latin-1')!r}: bodies must be application/json"
        )


def check_trailer(req: Request, name: bytes, value: bytes) -> None:
    """A trailer field after a chunked body: counted against the head's limits and dropped
    (the proxy forwards a body with a Content-Length, so no trailer reaches a replica)."""
    req.head_size += len(name) + len(value) + 4
    req.fields += 1
    if req.head_size > HEAD_LIMIT:
        raise Refused(431, TOO_LARGE + " (trailers included)")
    if req.fields > MAX_FIELDS:
        raise Refused(431, TOO_MANY + " (trailers included)")


def refusal(exc: httptools.HttpParserError, in_head: bool) -> Refused:
    """llhttp's refusal (or ours, raised from a callback) as an answer saying what was wrong."""
    if isinstance(exc.__context__, Refused):
        return exc.__context__
    reason = str(exc)
    low = reason.lower()
    if "content-length" in low and "transfer-encoding" in low:  # a request smuggling form
        return Refused(400, f"both Content-Length and Transfer-Encoding ({reason})")
    if "http version" in low:
        return Refused(505, f"unsupported HTTP version ({reason}): only HTTP/1.0 and 1.1")
    if not in_head:
        return Refused(400, f"malformed request body: {reason}")
    if "header" in low or "content-length" in low or "transfer-encoding" in low:
        return Refused(400, f"malformed header: {reason}")
    return Refused(400, f"malformed request line: {reason}")
