"""Request bodies: the 8 MiB cap (checked before parsing) and JSON decoding, for the Django
views and the completions ASGI app alike."""

import json

from .errors import ApiError
from .schemas import MAX_BODY_BYTES


def too_large() -> ApiError:
    return ApiError(
        413, "request_too_large", f"The request body exceeds {MAX_BODY_BYTES} bytes (8 MiB)."
    )


def check_declared_length(content_length: str | None) -> None:
    """413 request_too_large when a Content-Length header announces more than the cap."""
    if content_length and content_length.isdigit() and int(content_length) > MAX_BODY_BYTES:
        raise too_large()


def decode_json(raw: bytes):
    """The decoded body (`raw` may be one byte over the cap: that is the 413); 400 bad_json."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, "bad_json", f"The body is not valid JSON: {error}.") from None
