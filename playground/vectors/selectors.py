"""Reads of the user's vector library."""

from django.http import Http404

from playground.models import SteeringVector


def vectors_for_user(*, user) -> list[SteeringVector]:
    return list(SteeringVector.objects.filter(user=user).defer("data"))


def vector_for_user(*, user, vector_id) -> SteeringVector:
    vector = SteeringVector.objects.filter(pk=vector_id, user=user).first()
    if vector is None:
        raise Http404("No such vector.")
    return vector
