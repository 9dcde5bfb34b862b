"""node/warm_ask.py's pure parts: which worker commands and environments a warm launcher can serve."""

import pytest

from node import contract, warm_ask


@pytest.mark.parametrize(
    "args, expected",
    [
        (["/v/bin/python", "-u", "train.py", "--lr", "1"], ("/v/bin/python", "train.py", ["train.py", "--lr", "1"])),
        (["/v/bin/python", "-u", "-m", "pkg.train", "x"], ("/v/bin/python", "-m pkg.train", ["pkg.train", "x"])),
        (["/v/bin/python", "-X", "dev", "train.py"], None),  # an interpreter option the fork cannot take
        (["./train.sh"], None),  # torchrun --no-python
    ],
)
def test_only_python_scripts_and_modules_are_forked(args, expected):
    assert warm_ask.script_of(args) == expected


def test_only_variables_read_at_import_must_match_the_launchers():
    env = {
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "x.so",
        "PYTHONHASHSEED": "0",
        "TORCH_FR_BUFFER_SIZE": "2000",  # read when a process group is made: the launch's own
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # torchrun's, per worker
        "TORCHELASTIC_RESTART_COUNT": "2",
        "PYTHONPATH": "/job",
        "PYTHONFAULTHANDLER": "1",  # applied by the forked rank itself
        "RANK": "3",
    }
    assert warm_ask.import_time_environment(env) == {
        "OMP_NUM_THREADS": "1",
        "LD_PRELOAD": "x.so",
        "PYTHONHASHSEED": "0",
    }


def test_the_switch_is_on_unless_the_node_or_the_launch_turns_it_off():
    assert warm_ask.wanted({}) is (warm_ask.DEFAULT == "1")
    assert warm_ask.wanted({contract.WARM_VARIABLE: "0"}) is False
    assert warm_ask.wanted({contract.WARM_VARIABLE: "1"}) is True
    assert not contract.WARM_VARIABLE.startswith(contract.RESERVED_PREFIXES)  # `--env` may set it


def test_a_home_too_deep_for_a_socket_gets_a_short_private_folder():
    deep = "/home/" + "d" * 120
    path = warm_ask.socket_path(deep)
    assert len(path.encode()) <= 107 and path.startswith("/tmp/gpu-cluster-warm-")
    assert warm_ask.socket_path("/home/u") == "/home/u/" + contract.WARM_SOCKET
