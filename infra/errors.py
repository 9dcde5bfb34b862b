"""The errors a user sees as one line; the exit code says whose fault it was."""


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
