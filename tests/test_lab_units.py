"""The parallelism lab's pure pieces, directly: the fab task table, mesh validation, byte accounting,
the check line, memory accounting and the sharded checkpoints' commit marker."""

import pytest

from conftest import REPO
from remote import tasks


def test_the_task_table_registers_every_example_task_with_its_help():
    registered = tasks.ns.task_names
    for example in tasks.EXAMPLE_TASKS:
        assert example.name in registered, example.name
        assert (REPO / example.script).is_file(), example.script
        fab_task = tasks.ns[example.name]
        assert fab_task.__doc__ == example.help
        assert set(fab_task.help) >= {"args", "max-restarts", "stack"}
    assert len({example.name for example in tasks.EXAMPLE_TASKS}) == len(tasks.EXAMPLE_TASKS)
