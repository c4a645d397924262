"""The web suite's pytest-xdist groups (tests/conftest.py) reach pytest-xdist's scheduler."""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from xdist.remote import WorkerInteractor

from tests import conftest as suite_conftest


class CollectedTest:
    """What the two collection hooks read and write of a collected test."""

    def __init__(self, path: Path, fixturenames=()):
        self.path = path
        self.fixturenames = list(fixturenames)
        self._nodeid = f"{path.name}::test_it"
        self.marks = []

    @property
    def nodeid(self) -> str:
        return self._nodeid

    def add_marker(self, marker) -> None:
        self.marks.append(marker.mark)

    def iter_markers(self, name: str):
        return (mark for mark in self.marks if mark.name == name)


class XdistWorker:
    """pytest-xdist's worker-side collection hook (the one that writes each grouped test's
    group into its id), registered as a worker registers its WorkerInteractor: after the
    conftests."""

    pytest_collection_modifyitems = WorkerInteractor.pytest_collection_modifyitems


def test_the_fault_suite_and_the_real_engines_tests_are_grouped_before_xdist_reads_the_groups(
    request,
):
    """Runs in one process too: this suite's collection hook and pytest-xdist's worker hook,
    called in the order this pytest calls them (a worker registers its hook after the
    conftests, so without `tryfirst` it would run first and see no group), leave the fault
    suite's tests, the real engine's and the gateway replicas' with their group in their ids,
    and no other."""
    tests = Path(suite_conftest.__file__).parent
    fault = CollectedTest(suite_conftest.FAULTS_DIR / "test_a_fault.py", ["engine_url"])
    engine = CollectedTest(tests / "gateway" / "test_engine_e2e.py", ["db", "engine_url"])
    replica = CollectedTest(suite_conftest.REPLICAS_MODULE, ["db", "replicas"])
    plain = CollectedTest(tests / "gateway" / "test_completions.py", ["db", "client"])
    plugins = request.config.pluginmanager
    assert plugins.is_registered(suite_conftest), "tests/conftest.py is not the loaded conftest"
    worker = XdistWorker()
    plugins.register(worker, name="a pytest-xdist worker's collection hook")
    try:
        others = [p for p in plugins.get_plugins() if p not in (suite_conftest, worker)]
        collection_hooks = plugins.subset_hook_caller("pytest_collection_modifyitems", others)
        under_loadgroup = SimpleNamespace(getvalue={"loadgroup": True}.__getitem__)
        collection_hooks(
            session=request.session, config=under_loadgroup, items=[fault, engine, replica, plain]
        )
    finally:
        plugins.unregister(worker)
    assert fault.nodeid == "test_a_fault.py::test_it@faults"
    assert engine.nodeid == "test_engine_e2e.py::test_it@engine"
    assert replica.nodeid == "test_replicas.py::test_it@replicas"
    assert plain.nodeid == "test_completions.py::test_it"


def test_the_fault_suite_and_the_real_engines_tests_each_run_on_one_worker(request):
    """Under `--dist loadgroup` every grouped test's id carries its group, which is what the
    scheduler reads: a hook order or pytest version that loses it spreads them over both
    workers, each then loading the model or starting the fault suite's system again."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip(
            "not a pytest-xdist worker (one process, e.g. `WEB_WORKERS=`): nothing is scheduled "
            "(the test above checks the grouping in any process)"
        )
    assert request.config.getvalue("loadgroup"), "the web suite runs `--dist loadgroup`"
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group")]
    assert grouped, "no test of the fault suite or the real engine in this run"
    for item in grouped:
        group = item.get_closest_marker("xdist_group").args[0]
        assert item.nodeid.endswith(f"@{group}"), item.nodeid
