"""`fab` tasks for a running cluster; see `fab --list` and `fab --help TASK`, or remote/tasks.py."""

from fabric.main import program

from infra import state
from remote.cli import adopt
from remote.tasks import ns  # noqa: F401  (Fabric finds the task collection by this name)

adopt(program)  # bad input is one `error:` line and exit 2 (remote/cli.py says why this is done here)
state.keep_private()  # what fab writes under .cluster/ (run logs with arguments, results) is the user's alone
