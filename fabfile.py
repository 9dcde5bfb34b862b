"""`fab` tasks for a running cluster; see `fab --list` and `fab --help TASK`, or remote/tasks.py."""

from infra import state
from remote.tasks import ns  # noqa: F401  (Fabric finds the task collection by this name)

state.keep_private()  # what fab writes under .cluster/ (run logs with arguments, results) is the user's alone
