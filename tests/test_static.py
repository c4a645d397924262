"""Static files: the vendored plotly.js bundle matches the plotly package and draws every trace
type the figures use; in production, files are served hashed, compressed and cached for long."""

import ast
import re

import plotly
import plotly.graph_objects as go
from django.core.management import call_command
from django.templatetags.static import static
from django.test import AsyncClient, override_settings
from plotly.basedatatypes import BaseTraceType

from portal.figures import usage_figures
from testsupport.servers import REPO_ROOT

from .test_settings import load_settings, production

BUNDLE = REPO_ROOT / "static" / "vendor" / "plotly-acs-4.1.1.min.js"
PACKAGE_BUNDLE = plotly.__file__.replace("__init__.py", "package_data/plotly.min.js")
# Every module that may build a figure: the playground's (by feature) and the portal's.
FIGURE_MODULES = [*(REPO_ROOT / "playground").rglob("*.py"), REPO_ROOT / "portal" / "figures.py"]
TEN_YEARS = 315360000


def bundle_version(path) -> str:
    with open(path) as bundle:
        return re.search(r"plotly\.js .*?v(\d+\.\d+\.\d+)", bundle.read(300)).group(1)


def traces_used() -> set[str]:
    """The trace type of every `go.<Trace>` in the figure builders, and of the usage charts."""
    used = set()
    for module in FIGURE_MODULES:
        tree = ast.parse(module.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "go":
                candidate = getattr(go, node.attr)
                if isinstance(candidate, type) and issubclass(candidate, BaseTraceType):
                    used.add(candidate().type)
    for figure in usage_figures({"days": []}).values():
        used.update(trace["type"] for trace in figure["data"])
    return used


def test_the_vendored_plotly_bundle_is_the_version_of_the_plotly_package():
    assert bundle_version(BUNDLE) == bundle_version(PACKAGE_BUNDLE)


def test_the_vendored_plotly_bundle_has_exactly_the_trace_types_the_figures_use():
    # Every extra trace type costs each fresh browser time evaluating the bundle.
    in_bundle = set(re.findall(r'moduleType:"trace",name:"(\w+)"', BUNDLE.read_text()))
    used = traces_used()
    assert {"bar", "heatmap", "scatter"} <= used
    assert used == in_bundle


async def test_production_static_files_are_hashed_compressed_and_cached_for_years(
    monkeypatch, tmp_path
):
    source = tmp_path / "source"
    (source / "css").mkdir(parents=True)
    (source / "css" / "page.css").write_text("body { color: black; }\n" * 200)
    configured = load_settings(monkeypatch, **production())
    monkeypatch.undo()
    with override_settings(
        STORAGES=configured["STORAGES"],
        WHITENOISE_USE_FINDERS=configured["WHITENOISE_USE_FINDERS"],
        WHITENOISE_AUTOREFRESH=configured["WHITENOISE_AUTOREFRESH"],
        WHITENOISE_KEEP_ONLY_HASHED_FILES=configured["WHITENOISE_KEEP_ONLY_HASHED_FILES"],
        STATICFILES_DIRS=[source],
        STATICFILES_FINDERS=["django.contrib.staticfiles.finders.FileSystemFinder"],
        STATIC_ROOT=tmp_path / "collected",
    ):
        call_command("collectstatic", "--noinput", verbosity=0)
        url = static("css/page.css")
        assert re.fullmatch(r"/static/css/page\.[0-9a-f]{12}\.css", url)
        client = AsyncClient()
        response = await client.get(url, headers={"Accept-Encoding": "br, gzip"})
        assert response.status_code == 200
        assert response["Content-Encoding"] == "br"
        assert f"max-age={TEN_YEARS}" in response["Cache-Control"]
        assert "immutable" in response["Cache-Control"]
        gzipped = await client.get(url, headers={"Accept-Encoding": "gzip"})
        assert gzipped["Content-Encoding"] == "gzip"
    # Pages link only hashed names: the original is not kept, nor compressed.
    assert not (tmp_path / "collected" / "css" / "page.css").exists()


async def test_static_files_are_served_from_static_dir_in_development():
    response = await AsyncClient().get("/static/css/site.css")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")


def test_favicon_ico_leads_to_the_site_icon(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 302
    assert response["Location"] == static("img/favicon.svg")
