"""The one exception type the kit raises for problems a user can fix.

Every ``GrpoKitError`` message says what went wrong *and* what to do about it. The CLI prints such errors
without a traceback and exits with status 2; anything else is a bug and keeps its traceback.
"""


class GrpoKitError(Exception):
    """A problem with the user's input, settings or environment, with the fix spelled out in the message."""
