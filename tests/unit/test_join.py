"""node/join.py's refusals: what a replacement cannot join from says so in one line, exit 2, and writes nothing."""

import json

import pytest

from node import contract, join


def kit(shared, **changes) -> None:
    data = {
        "python": "python3",
        "requirements": "torch\n",
        "env": {"node-0": "export A=0\n", "node-1": "export A=1\n"},
        "scheduler": {"nodes": [{"name": "node-0", "address": "10.0.0.5"}, {"name": "node-1", "address": "10.0.0.6"}]},
    }
    data.update(changes)
    path = shared / contract.JOIN_KIT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if changes.get("raw") is None else changes["raw"])


@pytest.mark.parametrize(
    "node, setup, words",
    [
        ("node-1", None, "was not bootstrapped since it had a shared folder"),
        ("node-1", {"raw": "{"}, "cannot be read"),
        ("node-1", {"raw": "[]"}, "is not a join kit"),
        ("node-1", {"scheduler": []}, "is not a join kit"),
        ("node-1", {"scheduler": {"nodes": [{"name": "node-0"}]}}, "is not a join kit"),
        ("node-1", {"env": {"node-1": 7}}, "is not a join kit"),
        ("node-0", {}, "is the head node"),
        ("node-0", {"scheduler": None}, "is the head node"),  # runs held by fab: the env names the nodes
        ("node-7", {"scheduler": None}, "'node-7' is not a node of this cluster (its nodes: node-0, node-1)"),
        ("node-7", {}, "'node-7' is not a node of this cluster (its nodes: node-0, node-1)"),
    ],
)
def test_what_cannot_be_joined_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, node, setup, words):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    if setup is not None:
        kit(tmp_path, **setup)

    code = join.main(["--node", node, "--shared", str(tmp_path)])

    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert list(home.iterdir()) == []  # nothing written
