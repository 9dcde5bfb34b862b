"""Helpers the tests share that are not tests: the command lines as a user runs them, local clusters,
AWS and Pulumi fakes, stock OpenSSH hosts. Test modules import from here (`from tests.support.cli import
run_fab`), never from each other or from a conftest."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
