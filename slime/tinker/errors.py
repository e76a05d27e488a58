"""The two ways a Tinker request fails: the user's (bad input: a 400 at submission, or a failed
future of category "user") and the server's."""

from __future__ import annotations


class TinkerUserError(ValueError):
    """Bad input, named: the SDK shows the message (a 400's body, or the failed future's error)."""

    status = 400


class TinkerNotFound(TinkerUserError):
    """An unknown session, model, sampler or future."""

    status = 404


class TinkerGone(TinkerUserError):
    """A session that expired (no heartbeat for the timeout) or was finished."""

    status = 410
