"""fab's side of a node call (node/calls.py): one typed request, its reply, one error rule.

`call(session, python, request)` runs `node/calls.py` from the synced code folder with the request and
returns the reply dataclass; where there is none, one NodeCallError (the node, the verb, the exit code and
the node's one line): a refusal (bad input, other code than this fab's) is a UsageError too (exit 2), a
failure an OperationError too (exit 1).
"""

from infra.errors import NodeCallError
from infra.nodecall import version
from node import calls
from remote import node_paths
from remote.connect import NodeSession


def command(session: NodeSession, python: str, request: calls.Request) -> str:
    """The shell command that makes `request` on `session`'s node (from its home, as paths are given);
    one that carries a secret reads it from stdin (`call` sends it)."""
    words = ["-"] if request.SECRET else calls.command_words(request, version())
    return "cd && " + node_paths.node_module(session.cluster, python, "calls", *words)


def call(session: NodeSession, python: str, request: calls.Request, **run_options):
    """`request`'s reply from `session`'s node."""
    if request.SECRET:
        sent = calls.encoded(request, version()).encode()
        code, out, err = session.run_with_input(command(session, python, request), sent)
    else:
        result = session.run(command(session, python, request), **run_options)
        code, out, err = result.exited, result.stdout, result.stderr
    try:
        return calls.reply_from(request, code, out, err)
    except calls.CallError as exc:
        raise NodeCallError.of(session.node.name, exc.verb, exc.exit_code, exc.line) from None
