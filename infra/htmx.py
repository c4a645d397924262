"""Answers to htmx requests, which replace part of a page and leave the rest as it was."""

from django.template.loader import render_to_string
from django.utils.cache import patch_vary_headers


def wants_fragment(request) -> bool:
    """Whether to answer with the part of the page htmx swaps in: an htmx request, except
    htmx restoring a page of the browser's history, which puts the answer in place of the
    whole body (a page in `hx-history="false"` is always restored that way)."""
    return bool(request.htmx) and not request.htmx.history_restore_request


def varies_on_htmx(response):
    """Mark `response` as one of two answers at its URL, the page or its htmx fragment, so
    that the browser's cache never shows the fragment for the page (the back button to a URL
    that htmx pushed would show it bare)."""
    patch_vary_headers(response, ["HX-Request"])
    return response


def with_messages(request, response):
    """`response` plus the request's pending messages, swapped out of band into the page's
    message area (base.html's #messages), which an htmx answer does not otherwise reach."""
    context = {"out_of_band": True}
    response.content += render_to_string("_messages.html", context, request).encode()
    return response
