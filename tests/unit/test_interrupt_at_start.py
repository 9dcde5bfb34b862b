"""Ctrl-C while `deploy.py` or `fab` is still loading its modules (a second or more on a busy machine) is
'interrupted' and exit 130, as it is later, never a KeyboardInterrupt traceback (h51's audit)."""

import subprocess
import sys

import pytest

from tests.support import REPO

# Sends SIGINT to itself the moment `entry` (deploy.py or fabfile.py) imports `module`: inside the
# window where the imports load, whatever the machine's speed.
INTERRUPT_ON_IMPORT = """
import builtins, os, runpy, signal, sys
entry, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
real_import = builtins.__import__

def interrupting_import(name, globals=None, *args, **kwargs):
    if name == module and (globals or {}).get("__file__", "").endswith(entry):
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, globals, *args, **kwargs)

builtins.__import__ = interrupting_import
if entry == "deploy.py":
    sys.argv = ["deploy.py", *argv]
    runpy.run_path("deploy.py", run_name="__main__")
else:
    from fabric.main import program
    sys.argv = ["fab", *argv]
    program.run()
"""


@pytest.mark.parametrize(
    "entry,module,argv,said",
    [
        ("deploy.py", "infra", ["status"], "interrupted"),
        ("deploy.py", "infra.ssh", ["cost"], "interrupted"),
        ("fabfile.py", "remote.tasks", ["jobs"], "fab: interrupted (Ctrl-C)"),
    ],
)
def test_ctrl_c_while_loading_is_one_line_and_130(entry, module, argv, said, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "CLUSTER_STATE_DIR": str(tmp_path / "state"), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPT_ON_IMPORT, entry, module, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stderr.strip()) == (130, said), result.stderr[-2000:]
