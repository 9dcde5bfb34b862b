"""tests/unit: pure logic, so none of it sees the checkout's own `.cluster/` (a stack left up there by hand
would be priced into a test's new ledger); a test that wants a state folder asks for `state_dir`."""

import pytest


@pytest.fixture(autouse=True)
def _no_state_of_this_checkout(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CLUSTER_STATE_DIR", str(tmp_path_factory.mktemp("no-cluster-state")))
