"""The picks of a run page's logit-lens section: the heatmap's colours, the position of the
rank line and the attribution, the target and foil tokens (typed as text, each read by the
model's own tokenizer as exactly one token) and what the attribution explains."""

from dataclasses import dataclass

from django import forms

from playground.lens.tables import LensWeights, NotOneToken

LENS_COLOURS = {"top": "the top token's probability", "target": "the target's logprob"}
ATTRIBUTED = {"difference": "logit(target) − logit(foil)", "logit": "the target's logit alone"}
# The whitespace marks every figure shows tokens with (plots.visible_token), typed back.
VISIBLE_WHITESPACE = {"·": " ", "⏎": "\n", "⇥": "\t"}


def typed_token(text: str) -> str:
    """A token as typed, with the page's whitespace marks read as the whitespace they show."""
    for mark, whitespace in VISIBLE_WHITESPACE.items():
        text = text.replace(mark, whitespace)
    return text


@dataclass(frozen=True)
class LensPicks:
    """What the lens section shows: `position` None is the last one; `target` None is the
    token that comes next at each position, `foil` None the likeliest other token at the
    last layer."""

    colour: str = "top"
    position: int | None = None
    target: int | None = None
    foil: int | None = None
    attributed: str = "difference"


class LensForm(forms.Form):
    prefix = "lens"

    colour = forms.ChoiceField(label="Colour", choices=list(LENS_COLOURS.items()), initial="top")
    position = forms.TypedChoiceField(
        label="Position (rank and attribution)", coerce=int, required=False, empty_value=None
    )
    target = forms.CharField(
        label="Target token",
        required=False,
        strip=False,
        max_length=200,
        help_text="Empty: the token that comes next at each position. A space may be typed "
        "as ·, as the figures show it.",
    )
    foil = forms.CharField(
        label="Foil token",
        required=False,
        strip=False,
        max_length=200,
        help_text="Empty: the likeliest other token at the last layer.",
    )
    attributed = forms.ChoiceField(
        label="Attribute", choices=list(ATTRIBUTED.items()), initial="difference"
    )

    def __init__(self, *args, weights: LensWeights, positions: list[tuple[int, str]], **kwargs):
        """`positions`: the (position, label) pairs the lens covers."""
        super().__init__(*args, **kwargs)
        self.weights = weights
        self.fields["position"].choices = positions
        self.fields["position"].initial = positions[-1][0]

    def _token(self, name: str) -> int | None:
        text = self.cleaned_data[name]
        if not text:
            return None
        try:
            return self.weights.token_id(typed_token(text))
        except NotOneToken as error:
            raise forms.ValidationError(str(error)) from None

    def clean_target(self) -> int | None:
        return self._token("target")

    def clean_foil(self) -> int | None:
        return self._token("foil")

    def picks(self) -> LensPicks:
        """The picks of a valid form; the defaults for an unbound or invalid one."""
        if not self.is_bound or not self.is_valid():
            return LensPicks()
        return LensPicks(**self.cleaned_data)
