"""`Outcome`: what became of one key of a batch call (put, save, load, release, evict, ...).

A `StrEnum`, so an outcome still equals its name (`Outcome.STORED == "stored"`) and prints as
it. The names are the Rust client's (`done`, `stored`, and the wire error codes); the package's
tests check this list against the native module's `OUTCOMES`.
"""

from __future__ import annotations

import enum
from typing import Iterable, List, Optional, Union

from ._native import Reserved


class Outcome(enum.StrEnum):
    """One key's outcome."""

    #: Released, evicted, committed, aborted, loaded or saved (the server copied it).
    DONE = "done"
    #: A new chunk was stored.
    STORED = "stored"
    #: The chunk was there already (nothing written).
    ALREADY_PRESENT = "already_present"
    NOT_FOUND = "not_found"
    BUSY = "busy"
    TOO_LARGE = "too_large"
    NO_SPACE = "no_space"
    LEASE_LIMIT = "lease_limit"
    QUOTA_EXCEEDED = "quota_exceeded"
    DRAINING = "draining"
    STALE_GENERATION = "stale_generation"
    INVALID_ARGUMENT = "invalid_argument"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    DEVICE_ERROR = "device_error"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    MALFORMED = "malformed"
    VERSION_MISMATCH = "version_mismatch"
    PERMISSION_DENIED = "permission_denied"
    UNKNOWN_NAMESPACE = "unknown_namespace"
    NAMESPACE_CONFLICT = "namespace_conflict"
    TOO_MANY_SESSIONS = "too_many_sessions"

    @property
    def ok(self) -> bool:
        """The key ended as asked: done, stored, or already present."""
        return self in (Outcome.DONE, Outcome.STORED, Outcome.ALREADY_PRESENT)


def outcomes(names: Iterable[str]) -> List[Outcome]:
    """The native module's outcome names as `Outcome`s."""
    return [Outcome(n) for n in names]


def maybe_outcomes(names: Optional[Iterable[str]]) -> Optional[List[Outcome]]:
    return None if names is None else outcomes(names)


def slots(answers: Iterable[Union[Reserved, str]]) -> List[Union[Reserved, Outcome]]:
    """`reserve`'s answers: each a `Reserved`, or the `Outcome` saying why not."""
    return [a if isinstance(a, Reserved) else Outcome(a) for a in answers]
