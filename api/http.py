"""What every /v1 view of the Django handler shares: the request id, the `v1_view` decorator
(allowed methods, and every refusal answered in the API's error envelope), JSON bodies in and
out."""

import functools

from django.http import HttpResponse

from acs_client.responses import GatewayBody
from metering.budgets import BudgetExceeded
from metering.sql import DatabaseBusy

from .bodies import check_content_type, check_declared_length, decode_json
from .completions import CompletionResult
from .errors import ApiError, error_response, metering_refusal
from .limits import MAX_BODY_BYTES
from .middleware import request_id_for


def request_id(request) -> str:
    """The request's id, set by RequestIdMiddleware (echoed inbound or generated)."""
    return getattr(request, "request_id", None) or request_id_for(request)


def v1_view(*methods):
    """Decorate an async /v1 view: other methods get 405 method_not_allowed (with Allow), and
    an `ApiError` the view raises, or a metering refusal (a spent budget or quota, a busy
    database), is answered in the API's error envelope. Anything else is the middleware's
    500 envelope."""

    def decorate(view):
        @functools.wraps(view)
        async def wrapper(request, *args, **kwargs):
            if request.method not in methods:
                error = ApiError("method_not_allowed", f"Use {' or '.join(methods)}.")
                response = error_response(error, request_id(request))
                response["Allow"] = ", ".join(methods)
                return response
            try:
                return await view(request, *args, **kwargs)
            except ApiError as error:
                return error_response(error, request_id(request))
            except (BudgetExceeded, DatabaseBusy) as refusal:
                return error_response(metering_refusal(refusal), request_id(request))

        wrapper.allowed_methods = methods
        return wrapper

    return decorate


def read_json_body(request):
    """The decoded JSON body; 415 unsupported_media_type unless it is declared as JSON, 413
    request_too_large (checked before parsing, from the declared length and then the bytes
    actually sent) or 400 bad_json."""
    check_content_type(request.headers.get("Content-Type"))
    check_declared_length(request.headers.get("Content-Length"))
    # Read the stream directly: request.body would apply Django's smaller form-upload limit.
    return decode_json(request.read(MAX_BODY_BYTES + 1))


def json_response(request, body: GatewayBody, status=200) -> HttpResponse:
    """`body`, a response model of `acs_client.responses`, as JSON with the request's
    X-Request-Id. A model and never a dict: a view cannot answer a field its model (and so
    the OpenAPI document) lacks."""
    response = HttpResponse(body.model_dump_json(), status=status, content_type="application/json")
    response["X-Request-Id"] = request_id(request)
    return response


def result_response(request, result: CompletionResult) -> HttpResponse:
    """The response of a completion result (a stored job result too), compressed when the
    client accepts it."""
    content, headers = result.for_client(request.headers.get("Accept-Encoding", ""))
    response = HttpResponse(content, status=result.status, content_type="application/json")
    for name, value in headers.items():
        response[name] = value
    response["X-Request-Id"] = request_id(request)
    return response
