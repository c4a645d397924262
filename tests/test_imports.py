"""The import rules of the project's apps, read from the source (ast) of every module.

Dependencies between apps point one way: portal → {api, metering, accounts} and
playground → {api, metering, accounts}, side by side (neither imports the other),
api → metering → accounts; `accounts` imports no other project app, and `engine` and
`acs_client` no Django app. Every Django app may import `infra`, which imports none of
them; `acs_portal` (settings, URLs, ASGI, the Celery app) stands above them all, and no
app imports it. Within an app, no two modules import each other, directly or through
others: an import inside a function counts as much as one at the top of the module, so a
lazy import cannot hide a cycle. No module takes a private
name (`_name`) from another module of ours: what two modules share is public in one of them.
And no `ApiError` is given an HTTP status: `api.errors.ERROR_CODES` gives each code its one.
An app renders no template from another app's folder (`templates/<app>/`).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The project packages and the project packages each may import (acs_portal, the project's
# own configuration package, imports all and is imported by none).
ALLOWED = {
    "infra": set(),
    "accounts": {"infra"},
    "metering": {"accounts", "infra"},
    "api": {"metering", "accounts", "acs_client", "infra"},
    "playground": {"api", "metering", "accounts", "acs_client", "infra"},
    # Not the playground: the Jobs page is the portal's own, and the playground key (which
    # both use) is an API key, the accounts app's.
    "portal": {"api", "metering", "accounts", "acs_client", "infra"},
    "acs_client": set(),
    "engine": {"acs_client"},
}
PROJECT = {*ALLOWED, "acs_portal"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for app in PROJECT:
        for path in (ROOT / app).rglob("*.py"):
            if "migrations" not in path.parts:
                modules[module_name(path)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that the module `name` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                # `from package import module` imports the module; otherwise a name of `base`.
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
    return {module for module in found if module.split(".")[0] in PROJECT}


def private_imports(name: str, source: str, *, is_package: bool = False) -> list[str]:
    """`from x import _name` in the module `name` where x is another project module."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join([*anchor, base] if base else anchor)
        if base.split(".")[0] in PROJECT and base != name:
            found += [f"{name} imports {base}.{alias.name}" for alias in node.names]
    return [line for line in found if line.rpartition(".")[2].startswith("_")]


def api_errors_given_a_status(source: str) -> list[str]:
    """Calls `ApiError(...)` that pass an HTTP status: an int literal or a `status=` anywhere,
    or more than the two positional arguments (code, message)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        callee = node.func.attr if isinstance(node.func, ast.Attribute) else node.func
        if getattr(callee, "id", callee) != "ApiError":
            continue
        has_int = any(isinstance(arg, ast.Constant) and type(arg.value) is int for arg in node.args)
        if has_int or len(node.args) > 2 or any(k.arg == "status" for k in node.keywords):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def foreign_templates(name: str, source: str) -> list[str]:
    """Template names ("app/page.html", "app/page.html#part") in the module `name` that lie
    in another project app's folder of templates/."""
    app = name.split(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            folder, _, rest = node.value.partition("/")
            is_template = rest.partition("#")[0].endswith(".html")
            if is_template and folder in PROJECT and folder != app:
                found.append(f"{name} renders {node.value}")
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def app_rule_violations(graph: dict[str, set[str]]) -> list[str]:
    violations = []
    for module, imported in sorted(graph.items()):
        app = module.split(".")[0]
        if app == "acs_portal":
            continue
        for target in sorted(imported):
            target_app = target.split(".")[0]
            if target_app not in {app, *ALLOWED[app]}:
                violations.append(f"{module} imports {target}")
    return violations


def cycles_within_apps(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles among the modules of one app (top-level package), each listed once."""
    cycles, done = [], set()

    def visit(module, trail):
        if module in trail:
            cycles.append([*trail[trail.index(module) :], module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            if target.split(".")[0] == module.split(".")[0] and target != module:
                visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return cycles


def test_apps_import_only_the_apps_below_them():
    assert app_rule_violations(import_graph()) == []


def test_no_import_cycles_between_the_modules_of_an_app():
    assert cycles_within_apps(import_graph()) == []


def test_no_module_imports_a_private_name_of_another():
    violations = [
        line
        for name, path in project_modules().items()
        for line in private_imports(name, path.read_text(), is_package=path.name == "__init__.py")
    ]
    assert violations == []


def test_no_api_error_is_given_a_status():
    paths = [*project_modules().values(), *(ROOT / "tests").rglob("*.py")]
    violations = [
        f"{path.relative_to(ROOT)} {line}"
        for path in paths
        for line in api_errors_given_a_status(path.read_text())
    ]
    assert violations == []


def test_no_app_renders_the_templates_of_another():
    violations = [
        line
        for name, path in project_modules().items()
        for line in foreign_templates(name, path.read_text())
    ]
    assert violations == []


def test_the_template_check_catches_a_page_of_another_app():
    source = 'render(request, "accounts/keys.html#key_list")\nrender(request, "usage/usage.html")\n'
    assert foreign_templates("portal.views", source) == [
        "portal.views renders accounts/keys.html#key_list"
    ]
    assert foreign_templates("accounts.views", 'render(request, "accounts/apply.html")') == []


def test_the_checks_catch_a_private_import_and_an_api_error_with_a_status():
    source = (
        "from api.views import _json, allow\n"
        "from .errors import _TYPE_BY_STATUS\n"
        "from . import _helpers\n"
        "from acs_portal.celery import task_send\n"
        "from django.db import _private\n"
    )
    assert private_imports("api.jobs.views", source) == [
        "api.jobs.views imports api.views._json",
        "api.jobs.views imports api.jobs.errors._TYPE_BY_STATUS",
        "api.jobs.views imports api.jobs._helpers",
    ]
    assert private_imports("api.views", "def _json(): pass\nfrom api.views import _json") == []
    source = (
        'ApiError(404, "not_found", "no")\n'
        "errors.ApiError(entry.status, code, message)\n"
        'ApiError(code="queue_full", message="busy", status=429)\n'
        'ApiError("not_found", "no", retry_after=2)\n'
        'AcsApiError(404, "not_found", "no")\n'
    )
    assert [line.split(":")[0] for line in api_errors_given_a_status(source)] == [
        "line 1",
        "line 2",
        "line 3",
    ]


def test_the_rules_catch_a_forbidden_import_and_a_cycle():
    graph = {
        "accounts.views": {"metering.selectors"},
        "metering.selectors": {"accounts.models"},
        "api.jobs.services": {"api.jobs.tasks"},
        "api.jobs.tasks": {"api.jobs.services"},
        "infra.redis": {"metering.leases"},
        "playground.views": {"acs_portal.celery"},
    }
    assert app_rule_violations(graph) == [
        "accounts.views imports metering.selectors",
        "infra.redis imports metering.leases",
        "playground.views imports acs_portal.celery",
    ]
    assert cycles_within_apps(graph) == [
        ["api.jobs.services", "api.jobs.tasks", "api.jobs.services"]
    ]


def test_scripts_and_benches_use_the_test_support_package_not_the_tests():
    """bench/ and scripts/ share the tests' helpers through `testsupport`; a test module can
    change without breaking a bench."""
    sources = [*(ROOT / "bench").glob("*.py"), *(ROOT / "scripts").iterdir()]
    violations = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in sources
        if path.is_file()
        for line in path.read_text(errors="replace").splitlines()
        if line.split()[:2] in (["from", "tests"], ["import", "tests"])
        or line.lstrip().startswith(("from tests.", "import tests."))
    ]
    assert violations == []


def test_the_portal_imports_no_playground_module():
    """The two apps stand side by side: the Jobs page's submissions are the portal's, and
    the request log links to the playground by URL."""
    graph = import_graph()
    assert [
        f"{module} imports {target}"
        for module, imported in sorted(graph.items())
        if module.split(".")[0] == "portal"
        for target in sorted(imported)
        if target.split(".")[0] == "playground"
    ] == []


# A module a newcomer can read through; past this, split it by concern.
MAX_PLAYGROUND_MODULE_LINES = 500


def modules_over(limit: int, paths) -> list[str]:
    """The modules among `paths` with more than `limit` lines, each with its count."""
    counts = {path: len(path.read_text().splitlines()) for path in paths}
    return [f"{path}: {n} lines" for path, n in sorted(counts.items()) if n > limit]


def test_no_playground_module_is_over_500_lines():
    paths = [path for path in (ROOT / "playground").rglob("*.py") if "migrations" not in path.parts]
    assert modules_over(MAX_PLAYGROUND_MODULE_LINES, paths) == []


def test_the_line_limit_catches_a_long_module(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * 501)
    short.write_text("x = 1\n" * 500)
    assert [line.split(": ")[1] for line in modules_over(500, [long, short])] == ["501 lines"]
