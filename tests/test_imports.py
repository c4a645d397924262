"""The import rules of the project's apps, read from the source (ast) of every module.

Dependencies between apps point one way: portal → {playground, api, metering, accounts},
playground → {api, metering, accounts}, api → metering → accounts; `accounts` imports no
other project app, and `engine` and `acs_client` no Django app. Within an app, no two modules
import each other, directly or through others: an import inside a function counts as much as
one at the top of the module, so a lazy import cannot hide a cycle.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The project apps and the project apps each may import (acs_portal, the project's own
# configuration package, may be imported by all and imports all).
ALLOWED = {
    "accounts": set(),
    "metering": {"accounts"},
    "api": {"metering", "accounts", "acs_client"},
    "playground": {"api", "metering", "accounts", "acs_client"},
    "portal": {"playground", "api", "metering", "accounts"},
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
            if target_app not in {app, "acs_portal", *ALLOWED[app]}:
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


def test_the_rules_catch_a_forbidden_import_and_a_cycle():
    graph = {
        "accounts.views": {"metering.selectors"},
        "metering.selectors": {"accounts.models"},
        "api.jobs.services": {"api.jobs.tasks"},
        "api.jobs.tasks": {"api.jobs.services"},
    }
    assert app_rule_violations(graph) == ["accounts.views imports metering.selectors"]
    assert cycles_within_apps(graph) == [
        ["api.jobs.services", "api.jobs.tasks", "api.jobs.services"]
    ]
