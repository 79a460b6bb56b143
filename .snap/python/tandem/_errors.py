"""Exceptions carrying libtandem's status and message.

Every failed C call raises the subclass of TandemError for its tandem_status_t. `status` is the C value,
`status_name` its enumerator, and the message is tandem_last_error()'s (what failed, why, and what to do).
InvalidArgument is also a ValueError, OutOfMemory a MemoryError, Timeout a TimeoutError, so generic handlers work.
"""

from __future__ import annotations


class TandemError(RuntimeError):
    """A libtandem call failed. `status`: the tandem_status_t value; `status_name`: e.g. 'TANDEM_ERROR_PEER_LOST'."""

    status = -1
    status_name = "TANDEM_ERROR"

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} [{self.status_name}]"


def _kind(name: str, status: int, *bases: type, doc: str) -> type:
    return type(name, (TandemError, *bases), {"status": status, "status_name": "TANDEM_ERROR_" + _snake(name),
                                               "__doc__": doc, "__module__": "tandem"})


def _snake(name: str) -> str:
    out = ""
    for i, c in enumerate(name):
        if c.isupper() and i:
            out += "_"
        out += c.upper()
    return out


InvalidArgument = _kind("InvalidArgument", 1, ValueError, doc="A bad argument or descriptor; nothing was written.")
ProtocolError = _kind("ProtocolError", 2, doc="A malformed frame or message between libtandem and tandemd.")
ProtocolError.status_name = "TANDEM_ERROR_PROTOCOL"
VersionMismatch = _kind("VersionMismatch", 3, doc="libtandem and tandemd speak different protocol versions.")
PermissionDenied = _kind("PermissionDenied", 4, PermissionError, doc="This uid/gid may not use the daemon.")
NotFound = _kind("NotFound", 5, LookupError, doc="An unknown buffer, communicator or op.")
OutOfMemory = _kind("OutOfMemory", 6, MemoryError, doc="The daemon or a device ran out of memory.")
Timeout = _kind("Timeout", 7, TimeoutError, doc="A wait or rendezvous ran past its deadline; the op may still finish.")
PeerLost = _kind("PeerLost", 8, doc="Another rank of the communicator died or aborted.")
DaemonLost = _kind("DaemonLost", 9, ConnectionError, doc="The connection to tandemd is gone; the session is dead.")
Aborted = _kind("Aborted", 10, doc="The communicator was aborted.")
Unsupported = _kind("Unsupported", 11, doc="The daemon's backend does not run this op, dtype or shape.")
Unavailable = _kind("Unavailable", 12, ConnectionError, doc="tandemd is not running or not reachable.")
InternalError = _kind("InternalError", 13, doc="A bug in libtandem or tandemd.")
InternalError.status_name = "TANDEM_ERROR_INTERNAL"
RingFull = _kind("RingFull", 14, doc="The submission ring stayed full past the timeout; nothing was lost.")

BY_STATUS = {cls.status: cls for cls in (InvalidArgument, ProtocolError, VersionMismatch, PermissionDenied, NotFound,
                                          OutOfMemory, Timeout, PeerLost, DaemonLost, Aborted, Unsupported,
                                          Unavailable, InternalError, RingFull)}


def error_for(status: int, message: str) -> TandemError:
    cls = BY_STATUS.get(status)
    if cls is None:
        e = TandemError(message, status)
        e.status_name = f"status {status}"
        return e
    return cls(message)
