"""Full-page screenshots of pages the browser suite visits, at a desktop and a phone width,
for a person to look at: written to $ACS_SCREENSHOT_DIR (default `.run/screenshots/`)."""

import os
from pathlib import Path

from .system import REPO_ROOT

WIDTHS = (1280, 390)
HEIGHT = 900


def screenshot_dir() -> Path:
    folder = Path(os.environ.get("ACS_SCREENSHOT_DIR") or REPO_ROOT / ".run" / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_screenshots(page, name: str, element: str | None = None) -> list[Path]:
    """Write `<name>-1280.png` and `<name>-390.png` of the page as it is now, full page (or
    of its `element`, a selector, alone); the page is left at the last width."""
    paths = []
    for width in WIDTHS:
        page.set_viewport_size({"width": width, "height": HEIGHT})
        # Charts follow the new width: wait until plotly has redrawn every one of them.
        page.evaluate(
            """() => window.Plotly && Promise.all([...document.querySelectorAll('.js-plotly-plot')]
                 .map(plot => window.Plotly.Plots.resize(plot)))"""
        )
        # An htmx swap still under way would detach the element mid-screenshot (seen on one
        # busy core): wait until no request, swap or settle is pending.
        page.wait_for_function(
            "() => !document.querySelector('.htmx-request, .htmx-swapping, .htmx-settling')"
        )
        path = screenshot_dir() / f"{name}-{width}.png"
        if element is None:
            page.screenshot(path=path, full_page=True)
        else:
            page.locator(element).screenshot(path=path)
        paths.append(path)
    return paths
