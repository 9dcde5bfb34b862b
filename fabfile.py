"""`fab` tasks for a running cluster; see `fab --list` and `fab --help TASK`, or remote/tasks.py."""

import signal
import sys


def _interrupted_while_loading(signum, frame):
    """Ctrl-C while the tasks load (seconds on a busy machine): nothing has run yet, so no traceback."""
    print("fab: interrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)


signal.signal(signal.SIGINT, _interrupted_while_loading)

from fabric.main import program  # noqa: E402

from infra import state  # noqa: E402
from remote.cli import adopt  # noqa: E402
from remote.tasks import ns  # noqa: F401, E402  (Fabric finds the task collection by this name)

adopt(program)  # bad input is one `error:` line and exit 2 (remote/cli.py says why this is done here)
state.keep_private()  # what fab writes under .cluster/ (run logs with arguments, results) is the user's alone
signal.signal(signal.SIGINT, signal.default_int_handler)  # loaded: Ctrl-C is the tasks' KeyboardInterrupt again
