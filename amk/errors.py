"""The one exception root of AMK, so the CLI can catch every expected failure in one place."""


class AmkError(Exception):
    """An expected, user-facing failure: the message is one line, with no traceback text."""
