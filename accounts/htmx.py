"""Answers to htmx requests, which replace part of a page and leave the rest as it was."""

from django.template.loader import render_to_string


def with_messages(request, response):
    """`response` plus the request's pending messages, swapped out of band into the page's
    message area (base.html's #messages), which an htmx answer does not otherwise reach."""
    context = {"out_of_band": True}
    response.content += render_to_string("_messages.html", context, request).encode()
    return response
