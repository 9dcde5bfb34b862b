"""A node file as one self-contained program, for the files sent as source rather than run from the code folder.

`stop_jobs.py` is sent as `python -c SOURCE` (`fab stop` and fail-fast must work on a node whose synced
code is stale or missing) and `cleanup.py` on stdin as `python3 - ARGS` (`deploy.py down` writes
nothing on the host, whose Python may be too old for the project). Neither can import its siblings
from a folder, so the sender inlines them: such a file imports them on one line of its own,
`from node import contract, procfs`, and `source()` replaces that line with each sibling's text, run
into a module of that name. Read as a module (the operator's side, the tests) the line imports as usual;
sent, it carries one home per fact with it rather than copies of it. The siblings inlined
(`contract.py`, `procfs.py`) parse on Python 3.7, as cleanup.py must.

probe.py, also sent on stdin (`up --hosts`), needs no sibling: it is self-contained.
"""

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
SIBLINGS = re.compile(r"^from node import (?P<names>\w+(?:, \w+)*)$", re.MULTILINE)


def source(name: str) -> str:
    """The text of `node/<name>.py` with its `from node import ...` line replaced by those modules."""
    text = (HERE / f"{name}.py").read_text()
    return SIBLINGS.sub(lambda match: _inline(match["names"].split(", ")), text, count=1)


def _inline(names: list[str]) -> str:
    lines = ["import types as _node_types"]
    for name in names:
        text = (HERE / f"{name}.py").read_text()
        lines.append(f"{name} = _node_types.ModuleType({name!r})")
        lines.append(f"exec(compile({text!r}, {name + '.py'!r}, 'exec'), {name}.__dict__)")
    return "\n".join(lines)
