"""Every test's fixtures (an isolated `.cluster/`) and the xdist groups. Clusters are fixtures of
tests/integration only; helpers that are not fixtures live in tests/support.

`tests/` is a package, so pytest puts the repository root on `sys.path`: tests import `deploy`, `infra`,
`remote`, `harness` and `tests.support` from there, and tests/unit and tests/integration may hold modules
of the same name (`tests.unit.test_hang`, `tests.integration.test_hang`)."""

from pathlib import Path

import pytest


@pytest.fixture
def state_dir(tmp_path, monkeypatch) -> Path:
    """A private `.cluster/` for this test; `CLUSTER_STACK` cleared so only the test picks stacks."""
    path = tmp_path / "cluster-state"
    monkeypatch.setenv("CLUSTER_STATE_DIR", str(path))
    monkeypatch.delenv("CLUSTER_STACK", raising=False)
    return path


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under xdist (`make test` runs `pytest -n ... --dist loadgroup`), a module whose tests share a
    module-scoped fixture (a running cluster) runs whole on one worker, in order, as it would alone;
    every other test is handed out on its own."""
    shared = {item.module.__name__ for item in items if _uses_a_shared_fixture(item)}
    for item in items:
        if item.module.__name__ in shared and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    # xdist hands out work in collection order: the longest modules first, so none starts last and runs
    # alone at the end (a hint only: a module not named keeps its place after them).
    items.sort(
        key=lambda item: (
            LONGEST_FIRST.index(item.module.__name__) if item.module.__name__ in LONGEST_FIRST else len(LONGEST_FIRST)
        )
    )


LONGEST_FIRST = [
    f"tests.integration.{name}"
    for name in (
        "test_remote",
        "test_scheduled_runs",
        "test_fitness",
        "test_spot_recovery",
        "test_hang",
        "test_dashboard",
        "test_existing_slurm",
        "test_spot_drill",
        "test_workdir",
    )
]
"""The modules that run whole on one worker (a shared cluster), by their time alone (pytest --durations=0
of the module, 2026-11-26, on a busy 2-core machine: 484, 375, 224, 204, 170, 118 s ...), longest first."""


def _uses_a_shared_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    ours = [d for defs in (info.name2fixturedefs.values() if info else ()) for d in defs if d.baseid]
    return bool({d.scope for d in ours} & {"module", "package", "session"})
