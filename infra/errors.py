"""The errors a user sees as one line; the exit code says whose fault it was."""

SHOWN_CHARS = 60
"""How much of a bad value an error line quotes: a pasted file or 5,000 digits are not echoed whole."""


def shown(value: object) -> str:
    """`value` as an error line quotes it: its repr, cut to SHOWN_CHARS characters."""
    text = repr(value)
    return (
        text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 5]}...{text[-1]} ({len(str(value))} characters)"
    )


class ClusterError(Exception):
    """A failure reported to the user in one line."""

    exit_code = 1


class UsageError(ClusterError):
    """Bad input or a missing prerequisite, found before anything was created."""

    exit_code = 2


class OperationError(ClusterError):
    """A step that was allowed to start and then failed."""

    exit_code = 1


class ReportedFailure(ClusterError):
    """A failure whose lines were already printed (a stage's per-node report): only the exit code is left."""

    def __init__(self, exit_code: int = 1):
        super().__init__("")
        self.exit_code = exit_code
