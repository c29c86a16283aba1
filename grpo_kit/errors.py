"""The one exception type the kit raises for problems a user can fix.

Every ``GrpoKitError`` message says what went wrong *and* what to do about it. The CLI prints such errors
without a traceback and exits with status 2; anything else is a bug and keeps its traceback.
"""


class GrpoKitError(Exception):
    """A problem with the user's input, settings or environment, with the fix spelled out in the message."""


def first_line(error: BaseException) -> str:
    """``error`` for a one-line message: its type and the first line of its text."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
