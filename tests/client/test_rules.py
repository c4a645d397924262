"""The request rules both the gateway and the forms apply, written once in
`acs_client.protocol`: here the layer list (a capture's, a steering vector's, a harvest's)."""

import pytest

from acs_client.protocol import RuleBroken, check_layer_list, harvest_layers


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ([], "'layers' must name at least one layer."),
        ([0, 30], "Layer 30 in 'layers' is out of range; this model has layers 0–29."),
        ([-1], "Layer -1 in 'layers' is out of range; this model has layers 0–29."),
        ([3, 4, 3], "'layers' names a layer twice."),
    ],
)
def test_a_layer_list_names_each_of_the_models_layers_at_most_once(layers, message):
    with pytest.raises(RuleBroken) as broken:
        check_layer_list(layers, n_layers=30, field="layers")
    assert (str(broken.value), broken.value.field) == (message, "layers")


def test_a_layer_list_within_the_model_passes():
    check_layer_list([29, 0, 7], n_layers=30, field="layers")


@pytest.mark.parametrize(
    ("requested", "layers"),
    [(None, [7, 15, 22]), ("all", list(range(30))), ([29, 0], [29, 0])],
)
def test_a_harvest_captures_the_quartile_layers_all_of_them_or_those_named(requested, layers):
    assert harvest_layers(requested, n_layers=30) == layers


def test_a_harvest_refuses_a_layer_the_model_lacks():
    with pytest.raises(RuleBroken) as broken:
        harvest_layers([0, 30], n_layers=30)
    assert str(broken.value) == "Layer 30 in 'layers' is out of range; this model has layers 0–29."
