"""Errors meant for the user: one line each, which the CLI prints before it exits with status 2."""

from __future__ import annotations

__all__ = ["StoreError", "UserError", "first_line"]


class UserError(Exception):
    """A problem with the user's input (an option, a path, a file); the message is one line."""


class StoreError(UserError):
    """A path, file or query the store (or a checkpoint, trace or history file) cannot use."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when the message is empty), for
    one-line user errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
