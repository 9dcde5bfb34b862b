"""`fab` tasks for a running cluster; see `fab --list` and `fab --help TASK`, or remote/tasks.py."""

from remote.tasks import ns  # noqa: F401  (Fabric finds the task collection by this name)
