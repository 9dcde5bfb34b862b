"""The node call (node/calls.py) over the providers' own SSH (asyncssh): what the local supervisor and
`deploy.py status` ask a node go through the same requests, replies and error rule as fab's calls
(remote/nodecall.py), and the same version: the digest of this checkout's node/."""

import functools
import shlex
from pathlib import Path

from infra import ssh
from infra.errors import NodeCallError
from infra.inventory import ClusterInfo, NodeInfo
from node import calls

NODE_CODE = Path(__file__).resolve().parent.parent / "node"


@functools.cache
def version() -> str:
    """The digest of the node code this checkout speaks (and bootstrap sends)."""
    return calls.code_version(str(NODE_CODE))


def command(python: str, code_dir: str, request: calls.Request) -> str:
    """The shell command that makes `request` on a node whose synced code is in `code_dir` (absolute, or
    `$HOME/...`: the command starts in the home)."""
    script = f"{code_dir.rstrip('/')}/node/calls.py".removeprefix("$HOME/")
    words = [python, script, *calls.command_words(request, version())]
    return "cd && " + " ".join(shlex.quote(word) for word in words)


async def call(
    cluster: ClusterInfo, node: NodeInfo, python: str, code_dir: str, request: calls.Request, timeout_s: float
):
    """`request`'s reply from `node`; NodeCallError (remote/nodecall.py's) where there is none."""
    result = await ssh.run(cluster, node, command(python, code_dir, request), timeout_s=timeout_s)
    code = result.exit_status if isinstance(result.exit_status, int) else calls.FAILED_EXIT
    try:
        return calls.reply_from(request, code, str(result.stdout or ""), str(result.stderr or ""))
    except calls.CallError as exc:
        raise NodeCallError.of(node.name, exc.verb, exc.exit_code, exc.line) from None
