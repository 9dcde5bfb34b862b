"""remote/free_space.py: a launch's room check on what the nodes said, and the line naming a full disk."""

import subprocess

import pytest

from infra.errors import UsageError
from remote import free_space


def test_the_nodes_own_command_says_its_free_space_and_makes_nothing(tmp_path):
    said = subprocess.run(
        ["sh", "-c", free_space.command()], env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, capture_output=True
    )
    room = free_space.parse(said.stdout.decode())
    assert room.node_kb is not None and room.node_kb > 0 and room.shared_kb is None  # no env file: no shared folder
    assert list(tmp_path.iterdir()) == []


def test_a_node_short_of_room_is_named_with_its_folder_what_is_free_and_needed():
    statuses = ["idle\nbootstrapped\nspace 900000 900000\n", "idle\nbootstrapped\nspace 2048 900000\n"]
    with pytest.raises(UsageError) as refused:
        free_space.check(["node-0", "node-1"], statuses)
    assert str(refused.value).startswith("node-1 has no room for a run: its run folder ~/.gpu-cluster/runs has 2.0 MiB")
    assert "a run needs 64 MiB" in str(refused.value)
    with pytest.raises(UsageError, match="node-0 has no room for a run: the shared folder's runs/ has 0.0 MiB"):
        free_space.check(["node-0"], ["space 900000 0\n"])
    free_space.check(["node-0", "node-1"], ["space 900000 900000", "idle\nbootstrapped\n"])  # one that cannot say


def test_a_log_that_ran_out_of_space_gives_one_line_naming_the_node():
    text = "[node-1] rank 1 before\n[node-1] OSError: [Errno 28] No space left on device\n"
    line = free_space.full_disk_line("node-1", text)
    assert line == (
        "fab: node-1 ran out of disk space during the run (No space left on device): "
        "[node-1] OSError: [Errno 28] No space left on device"
    )
    assert free_space.full_disk_line("node-0", "[node-0] fine\n") is None
