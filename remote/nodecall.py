"""fab's side of a node call (node/calls.py): one typed request, its reply, one error rule.

`call(session, python, request)` runs `node/calls.py` from the synced code folder with the request and
returns the reply dataclass; a node's refusal (bad input, other code than this fab's) is a UsageError
(exit 2), a failure an OperationError (exit 1), each the node's one line behind its name.
"""

import functools

from infra.errors import OperationError, UsageError
from node import calls
from remote import node_paths
from remote.connect import NodeSession


@functools.cache
def version() -> str:
    """The digest of the node code this fab speaks (and bootstrap sends)."""
    return calls.code_version(str(node_paths.NODE_CODE))


def command(session: NodeSession, python: str, request: calls.Request) -> str:
    """The shell command that makes `request` on `session`'s node (from its home, as paths are given)."""
    return "cd && " + node_paths.node_module(session.cluster, python, "calls", *calls.command_words(request, version()))


def call(session: NodeSession, python: str, request: calls.Request, **run_options):
    """`request`'s reply from `session`'s node."""
    result = session.run(command(session, python, request), **run_options)
    try:
        return calls.reply_from(request, result.exited, result.stdout, result.stderr)
    except calls.CallError as exc:
        error = UsageError if exc.bad_input else OperationError
        raise error(f"{session.node.name}: {exc.line}") from None
