"""The web suite's pytest-xdist groups (tests/conftest.py) reach pytest-xdist's scheduler."""


def test_the_fault_suite_and_the_real_engines_tests_each_run_on_one_worker(request):
    """Under `--dist loadgroup` every grouped test's id carries its group, which is what the
    scheduler reads: a hook order or pytest version that loses it spreads them over both
    workers, each then loading the model or starting the fault suite's system again."""
    if not request.config.getvalue("loadgroup"):
        return
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group")]
    assert grouped
    for item in grouped:
        group = item.get_closest_marker("xdist_group").args[0]
        assert item.nodeid.endswith(f"@{group}"), item.nodeid
