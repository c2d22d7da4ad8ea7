"""Errors raised for bad user input.

Every problem with user input (a flag, a file, a value) is reported as an
:class:`InputError` whose message is one line naming the input and the
problem, e.g. ``P1.hkl line 12: expected 'h k l F', got 3 fields``.  The
command-line tools print that line and exit with status 2; library callers can
catch the exception.
"""

from __future__ import annotations


class InputError(ValueError):
    """A user-supplied input (flag, value, file) is invalid.

    The message is a single line that names the input and the problem.
    """

    def __init__(self, message: str) -> None:
        message = " ".join(str(message).split())  # always one line
        super().__init__(message)
