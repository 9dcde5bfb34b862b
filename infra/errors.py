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


class NodeCallError(ClusterError):
    """A node call (node/calls.py) that got no reply: which node, which verb, the node's exit code (2: the
    request was refused as bad input, 1: the work failed; the same code the command exits with) and the
    node's one line. Shown as `node: line`; callers read the fields, never the text."""

    def __init__(self, node: str, verb: str, exit_code: int, line: str):
        super().__init__(f"{node}: {line}")
        self.node, self.verb, self.exit_code, self.line = node, verb, exit_code, line

    @classmethod
    def of(cls, node: str, verb: str, exit_code: int, line: str) -> "NodeCallError":
        """The error for the node's answer: a UsageError too where the node refused the request (exit 2),
        else an OperationError too."""
        kind = NodeRefused if exit_code == UsageError.exit_code else NodeCallFailed
        return kind(node, verb, exit_code, line)


class NodeRefused(NodeCallError, UsageError):
    """The node refused the request: bad input, or other node code than this fab speaks (exit 2)."""


class NodeCallFailed(NodeCallError, OperationError):
    """The node tried the work and it failed (exit 1)."""
