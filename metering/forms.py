"""Budget forms, built from `metering.windows.WINDOWS` when made (so a window declared there
is a field here): the limits a key's owner may set, all of a key's (staff), an account's
(staff). Their service (`metering.limits`) checks what the fields cannot, and its errors land
on the fields."""

from django import forms

from . import windows


class BudgetForm(forms.Form):
    """One integer field per limit of `budget_windows`, named by the limit's attribute, with its
    current value of `owner` (a key or an account) as initial."""

    def __init__(self, data=None, *, owner, budget_windows: list[windows.Window], prefix=None):
        super().__init__(data, prefix=prefix)
        for window in budget_windows:
            self.fields[window.limit] = forms.IntegerField(
                label=window.label,
                min_value=0,
                required=not window.optional,
                help_text="Empty: no separate limit." if window.optional else "",
                initial=getattr(owner, window.limit),
            )


def key_budget_form(key, data=None, *, staff: bool = False) -> BudgetForm:
    """The budgets of `key` that its owner may set, or all of them for `staff`."""
    return BudgetForm(
        data,
        owner=key,
        budget_windows=[
            window for window in windows.of_scope(windows.KEY) if staff or window.owner_sets
        ],
        prefix=f"{'staff-budget' if staff else 'budget'}-{key.pk}",
    )


def account_budget_form(user, data=None) -> BudgetForm:
    return BudgetForm(data, owner=user, budget_windows=windows.of_scope(windows.ACCOUNT))
