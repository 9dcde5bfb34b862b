"""What the tests share and are not tests themselves: the command lines as a user runs them, local
clusters, AWS and Pulumi fakes, stock OpenSSH hosts. Test modules import from here, never from each
other (`from tests.support.cli import run_fab`: `tests/` is a package, so pytest puts the repository
root on `sys.path`, and with it `deploy`, `infra`, `remote`, `harness`)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
