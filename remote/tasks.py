"""The `fab` tasks: prepare the nodes, launch jobs on all of them, watch and stop them; one collection of
the node tasks (remote/tasks_nodes.py), the launch tasks (remote/tasks_launch.py) and the run tasks
(remote/tasks_runs.py).

The cluster is the current stack's inventory (`--stack`, else $CLUSTER_STACK, else the last `up`).
"""

from invoke import Collection

from remote.tasks_launch import EXAMPLE_TASKS, example_task, run
from remote.tasks_nodes import bootstrap, clean_runs, gpus, preflight
from remote.tasks_runs import jobs, logs, results, stop

ns = Collection(
    bootstrap,
    *(example_task(example) for example in EXAMPLE_TASKS),
    run,
    preflight,
    gpus,
    logs,
    stop,
    clean_runs,
    jobs,
    results,
)
