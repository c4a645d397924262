"""Request bodies: the size cap (`limits.MAX_BODY_BYTES`, checked before parsing) and JSON
decoding, for the Django views and the completions ASGI app alike. Every /v1 body goes
through `decode_json`, which also refuses what would break later steps: nesting deeper than
`MAX_JSON_DEPTH` (the stdlib parser recurses once per level and raises RecursionError near
1000), strings holding a lone UTF-16 surrogate (`"\\ud800"` decodes to a str that cannot be
encoded to UTF-8, so the tokenizer, the database and the upstream request would all fail on
it), and strings holding NUL (`"\\u0000"`).

NUL is not text this API takes, on any endpoint: PostgreSQL's text and jsonb cannot store
it, so a job, a harvest or a playground run carrying it could not be saved, and a body must
mean the same on /v1/completions as in a completion job. A prompt that needs token 0's byte
can be sent as token ids. The portal's forms refuse it the same way (Django's text fields
do; the Jobs page's prompt files in `portal.jobs_forms.prompts_from_file`)."""

import asyncio
import json
import re

from django.conf import settings

from .errors import ApiError
from .limits import MAX_BODY_BYTES

# No valid body of the API nests deeper than 5 levels (a steering vector's codec object).
MAX_JSON_DEPTH = 64

# A JSON string, so that brackets inside strings are not counted as nesting.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte except brackets is deleted, and `}` / `{` become `]` / `[`.
_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
# Where a lone surrogate can come from: a \uD800–\uDFFF escape, or its UTF-8 bytes (which
# json.loads decodes with "surrogatepass"). Valid escaped pairs match too; `_lone_surrogate_at`
# then tells them apart.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
# Where a NUL can come from: only its escape (a raw NUL byte in a string is invalid JSON).
# An escaped backslash before "u0000" matches too; `_text_at` then tells them apart.
_MAYBE_NUL = re.compile(rb"\\u0000")


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


async def read_body(receive) -> bytes:
    """The ASGI request body, cut off one byte past the cap (which `decode_json` answers
    with 413). It must arrive within ACS_REQUEST_BODY_TIMEOUT_SECONDS, else 408
    request_timeout: a client trickling bytes (or sending none) cannot hold a connection and
    its buffer open for long. ClientGone when the client disconnects first."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientGone
                chunk = message.get("body", b"")
                if size <= MAX_BODY_BYTES:
                    chunks.append(chunk)
                    size += len(chunk)
                if not message.get("more_body"):
                    return b"".join(chunks)[: MAX_BODY_BYTES + 1]
    except TimeoutError:
        raise ApiError(
            "request_timeout",
            f"The request body did not arrive within "
            f"{settings.ACS_REQUEST_BODY_TIMEOUT_SECONDS} s.",
        ) from None


def replaying(body: bytes, receive):
    """An ASGI `receive` that delivers `body` (read by `read_body`) as the request, then
    passes on what `receive` says (the client's disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay():
        return pending.pop() if pending else await receive()

    return replay


def check_content_type(content_type: str | None) -> None:
    """415 unsupported_media_type unless the `Content-Type` header value declares JSON (any
    parameters, such as charset, aside): every /v1 body is JSON and must say so."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            "unsupported_media_type",
            f"Send the body as Content-Type: application/json, not {content_type!r:.100}.",
        )


def too_large() -> ApiError:
    return ApiError(
        "request_too_large",
        f"The request body exceeds {MAX_BODY_BYTES} bytes ({MAX_BODY_BYTES // 2**20} MiB).",
    )


def check_declared_length(content_length: str | None) -> None:
    """413 request_too_large when a Content-Length header announces more than the cap."""
    if content_length and content_length.isdigit() and int(content_length) > MAX_BODY_BYTES:
        raise too_large()


def decode_json(raw: bytes):
    """The decoded body (`raw` may be one byte over the cap: that is the 413); 400 bad_json,
    or 400 invalid_request for nesting too deep or a lone surrogate (naming its field)."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large()
    if _nested_deeper_than(raw, MAX_JSON_DEPTH):
        raise ApiError(
            "invalid_request",
            f"The body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep.",
        )
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError("bad_json", f"The body is not valid JSON: {error}.") from None
    if _MAYBE_SURROGATE.search(raw):
        field = _text_at(payload, (), _not_encodable)
        if field is not None:
            raise ApiError(
                "invalid_request",
                f"Invalid value for '{field}': it holds a lone UTF-16 surrogate (such as "
                "\\ud800), which is not valid Unicode text.",
            )
    if _MAYBE_NUL.search(raw):
        field = _text_at(payload, (), _holds_nul)
        if field is not None:
            raise ApiError(
                "invalid_request",
                f"Invalid value for '{field}': it holds a NUL character (\\u0000), which "
                "this API does not take in text; send such a prompt as token ids.",
            )
    return payload


def _nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the brackets of `raw` (outside strings) nest more than `limit` deep, found
    without parsing and at C speed: each round deletes every innermost `[]` pair, so what
    survives `limit` rounds nests deeper. Unclosed brackets count as open until the end."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):
        reduced = brackets.replace(b"[]", b"")
        if reduced == brackets:
            break
        brackets = reduced
    return b"[]" in brackets or brackets.count(b"[") > limit


def _text_at(value, path: tuple, is_bad) -> str | None:
    """The dotted path of the first string (or object key) in `value` for which
    `is_bad(string)`, or None."""
    if isinstance(value, str):
        return (".".join(map(str, path)) or "body") if is_bad(value) else None
    if isinstance(value, list):
        items = enumerate(value)
    elif isinstance(value, dict):
        items = value.items()
    else:
        return None
    for name, item in items:
        if isinstance(name, str) and is_bad(name):
            printable = name.encode("utf-8", "backslashreplace").decode().replace("\0", "\\u0000")
            return ".".join(map(str, (*path, printable)))
        found = _text_at(item, (*path, name), is_bad)
        if found is not None:
            return found
    return None


def _not_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _holds_nul(text: str) -> bool:
    return "\0" in text
