"""The run history: the user's runs filtered by kind, prompt text and steering vector, a
page at a time. The filters are the page's query string, so a filtered page can be
bookmarked."""

from django import forms
from django.core.paginator import Page, Paginator

from playground.models import RunKind, SteeringVector
from playground.runs import selectors

RUNS_PER_PAGE = 25


class HistoryFilterForm(forms.Form):
    kind = forms.ChoiceField(choices=[("", "Any kind"), *RunKind.choices], required=False)
    prompt = forms.CharField(required=False, max_length=200, label="Prompt contains", strip=False)
    vector = forms.ModelChoiceField(
        queryset=SteeringVector.objects.none(),
        required=False,
        empty_label="Any or none",
        label="Steering vector",
    )

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["vector"].queryset = SteeringVector.objects.filter(user=user).defer("data")


def runs_page(*, user, kind: str = "", prompt: str = "", vector=None, page=None) -> Page:
    """One page of the user's runs, newest first, without their responses: those of `kind`,
    whose prompt (any of them) contains `prompt` (case-insensitive), made with `vector`;
    a patching grid's cells only when `kind` asks for them (see `selectors.runs_listed`).
    A page number that is not one gives the first page, one past the end the last."""
    runs = selectors.runs_listed(user=user, kind=kind).defer("tokens")
    if prompt:
        runs = runs.filter(request__prompt__icontains=prompt)
    if vector is not None:
        runs = runs.filter(vector=vector)
    return Paginator(runs, RUNS_PER_PAGE).get_page(page)
