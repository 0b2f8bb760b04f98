"""The one exception type for user mistakes, shared by every layer (no dependencies)."""


class UserError(Exception):
    """A user mistake. ``str(err)`` is one line: what is wrong, the value, and the fix.

    CLIs print it as ``prog: error: <message>`` and exit with code 2, without a traceback.
    """


def article(word) -> str:
    """``word`` with its indefinite article, for messages (``an eagle``, ``a judge``)."""
    return f"{'an' if str(word)[:1].lower() in 'aeiou' else 'a'} {word}"
