"""A zero-latency vLLM-like upstream (raw ASGI, run by uvicorn in a thread) for gateway tests
and the gateway benchmark. Its behaviour is switched through `StubUpstream.mode`."""

import asyncio
import json
import threading

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from acs_client.codec import encode_vector
from acs_client.protocol import PROBE_HEADER, XARGS_CAPTURE
from testsupport.servers import serve_in_thread, stop_server

WORDS = ["[UNK]", "the", "capital", "of", "france", "is", "paris", "hello", "tok"]


def build_tokenizer() -> Tokenizer:
    """One token per whitespace-separated word."""
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


class StubUpstream:
    """Completions generate `max_tokens` tokens " tok" per choice. `mode` keys:
    `status` + `error` (answer every completion with that error), `retry_after`,
    `die_after` (close the connection after that many stream frames), `gap` (seconds
    between stream frames), `delay` (seconds before answering), `serve_tokenizer_json`,
    `stream_error_after` (send an error frame after that many frames), `healthy`, `gate` (a
    threading.Event completions wait for), `text` (each streamed token's text instead of
    " tok"), `plugin` (False: ignore `vllm_xargs`, as vLLM without vLLM-Lens; captures are
    otherwise answered as vLLM-Lens does, `hidden_size` wide, default 8), `logprob` (report
    this logprob, e.g. NaN, for
    every token, as Python's json writes it), `token` (refuse every request but /health
    without `Authorization: Bearer <token>` as the engine with ACS_ENGINE_TOKEN does: 401
    invalid_token), `models` (the model entries GET /v1/models lists, as vLLM's
    `{"id", "object": "model", "max_model_len", ...}`; without it, GET /v1/models is a 404),
    `large` (`large_mode(...)`: answer a non-streaming full-vocabulary request with a large
    body sent in chunks as it is generated)."""

    def __init__(self):
        self.tokenizer = build_tokenizer()
        self.tokenizer_json = self.tokenizer.to_str().encode()
        self.mode: dict = {"serve_tokenizer_json": True, "healthy": True}
        self.requests: list[dict] = []
        self.tenants: list[str] = []  # the X-Acs-Tenant of each completion request
        self.in_flight = 0
        self.max_in_flight = 0
        self.paths: list[str] = []
        self.probes = 0  # the gateway's capture probes (not in `requests`)
        self.server = None
        self.thread = None
        self.url = ""

    def count(self, prompt, add_special_tokens=True) -> int:
        if isinstance(prompt, list):
            return len(prompt)
        return len(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        self.paths.append(path)
        if self._unauthorised(scope):
            error = {"code": "invalid_token", "message": "needs the token"}
            await _json(send, {"error": {"type": "authentication_error", **error}}, 401)
        elif path == "/health":
            ok = self.mode.get("healthy", True)
            await _json(send, {"status": "ok", "model_loaded": ok}, 200 if ok else 503)
        elif path == "/tokenizer.json":
            if self.mode.get("serve_tokenizer_json", True):
                await _raw(send, self.tokenizer_json, 200)
            else:
                await _json(send, {"error": {"code": "not_found", "message": "no"}}, 404)
        elif path == "/v1/models" and "models" in self.mode:
            await _json(send, {"object": "list", "data": self.mode["models"]})
        elif path == "/tokenize":
            payload = json.loads(body)
            count = self.count(payload["prompt"], payload.get("add_special_tokens", True))
            await _json(send, {"tokens": list(range(count)), "count": count})
        elif path == "/v1/completions" and PROBE_HEADER.encode() in dict(scope["headers"]):
            self.probes += 1
            await self._completions(json.loads(body), send)
        elif path == "/v1/completions":
            headers = dict(scope["headers"])
            self.tenants.append(headers.get(b"x-acs-tenant", b"").decode())
            await self.completions(json.loads(body), send, receive)
        else:
            await _json(send, {"error": {"code": "not_found", "message": path}}, 404)

    async def completions(self, payload, send, receive=None):
        self.requests.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._completions(payload, send, receive)
        finally:
            self.in_flight -= 1

    def _unauthorised(self, scope) -> bool:
        token = self.mode.get("token")
        if not token or scope["path"] == "/health":
            return False
        return dict(scope["headers"]).get(b"authorization") != f"Bearer {token}".encode()

    def reset(self) -> None:
        self.mode = {"serve_tokenizer_json": True, "healthy": True}
        self.requests.clear()
        self.tenants.clear()
        self.paths.clear()
        self.probes = 0
        self.max_in_flight = 0

    async def _completions(self, payload, send, receive=None):
        mode = self.mode
        if mode.get("delay"):
            await asyncio.sleep(mode["delay"])
        while mode.get("gate") is not None and not mode["gate"].is_set():
            await asyncio.sleep(0.01)
        if mode.get("status"):
            headers = {"Retry-After": str(mode["retry_after"])} if mode.get("retry_after") else {}
            error = mode.get("error") or {"code": "boom", "message": "stub failure"}
            await _json(send, {"error": {"type": "x", **error}}, mode["status"], headers)
            return
        prompts = payload["prompt"]
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n, max_tokens = payload.get("n", 1), payload.get("max_tokens", 16)
        prompt_tokens = sum(self.count(p, payload.get("add_special_tokens", True)) for p in prompts)
        completion_tokens = len(prompts) * n * max_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        header = {"id": "cmpl-stub", "object": "text_completion", "created": 1, "model": "stub"}
        header["model"] = payload["model"]
        if mode.get("large") and payload.get("prompt_logprobs") == -1 and not payload.get("stream"):
            large = mode["large"]
            if "completion_tokens" in large:
                usage["completion_tokens"] = large["completion_tokens"]
                usage["total_tokens"] = prompt_tokens + large["completion_tokens"]
            counts = [self.count(p, payload.get("add_special_tokens", True)) for p in prompts]
            pieces = large_body(large, header, counts, n, max_tokens, usage, payload)
            await _send_large(send, receive, large, pieces)
            return
        capture = self._capture(payload, prompt_tokens + max_tokens - 1)
        if not payload.get("stream"):
            choices = []
            for i, prompt in enumerate(prompts):
                for j in range(n):
                    text = prompt if payload.get("echo") and isinstance(prompt, str) else ""
                    choice = {
                        "index": i * n + j,
                        "text": text + " tok" * max_tokens,
                        "logprobs": _logprobs(mode, max_tokens),
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                    if payload.get("prompt_logprobs") is not None:
                        choice["prompt_logprobs"] = [None] + [
                            {"1": {"logprob": -1.0, "rank": 1, "decoded_token": "the"}}
                        ] * (self.count(prompt) - 1)
                    choices.append(choice)
            await _json(send, {**header, "choices": choices, "usage": usage, **capture})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        frames = 0
        for step in range(max_tokens):
            for index in range(len(prompts) * n):
                if mode.get("die_after") is not None and frames >= mode["die_after"]:
                    raise ConnectionAbortedError("stub dies mid-stream")
                if mode.get("stream_error_after") is not None and (
                    frames >= mode["stream_error_after"]
                ):
                    error = {"error": {"code": "vllm_oom", "message": "out of memory", "type": "x"}}
                    await _frame(send, error)
                    await send({"type": "http.response.body", "body": b""})
                    return
                if mode.get("gap"):
                    await asyncio.sleep(mode["gap"])
                chunk = {
                    **header,
                    "choices": [
                        {
                            "index": index,
                            "text": mode.get("text", " tok"),
                            "logprobs": _logprobs(mode, 1),
                            "finish_reason": "length" if step == max_tokens - 1 else None,
                        }
                    ],
                }
                await _frame(send, chunk)
                frames += 1
        if (payload.get("stream_options") or {}).get("include_usage"):
            await _frame(send, {**header, "choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    def _capture(self, payload: dict, tokens: int) -> dict:
        """The `activations` of a capture asked in `vllm_xargs`, as vLLM-Lens sends them:
        layers in ascending order, each layer's values all equal to its index. Without the
        plugin (`plugin` False) vLLM ignores `vllm_xargs`: nothing."""
        layers = (payload.get("vllm_xargs") or {}).get(XARGS_CAPTURE)
        if layers is None or not self.mode.get("plugin", True):
            return {}
        values = np.ones((1, tokens, self.mode.get("hidden_size", 8)), np.float32)
        rows = np.concatenate([values * layer for layer in sorted(layers)])
        return {"activations": {"residual_stream": encode_vector(rows)}}

    def start(self) -> "StubUpstream":
        self.server, self.thread, self.url = serve_in_thread(self)
        return self

    def stop(self) -> None:
        stop_server(self.server, self.thread)


# Decoded tokens of `large_mode`'s vocabulary: plain words, and strings that hold the bytes
# a byte-level relay looks for (escaped in JSON, as they are within a real answer).
LARGE_TOKENS = [
    "tok",
    " the",
    ',"metrics":null',
    '"model":"x"',
    '"usage":{"prompt_tokens":1}',
    '"logprob":NaN',
    "\\",
    '\\"',
    "é\n",
    ',"token_ids":null}],',
]


def large_mode(
    *,
    vocab: int,
    shape: str = "vllm",
    chunk: int = 65536,
    extras: dict | None = None,
    usage: bool = True,
    pause: "threading.Event | None" = None,
    completion_tokens: int | None = None,
    break_after: int | None = None,
    content_type: str = "application/json",
) -> dict:
    """The stub's `large` mode: a non-streaming request with prompt_logprobs -1 is answered
    with `vocab` entries per prompt position (vLLM's {token id: {logprob, rank,
    decoded_token}}), sent in pieces of about `chunk` bytes as generated. `shape` "vllm":
    vLLM's members, its extras null but those in `extras` (name: value); "engine": the
    embedded engine's. `usage` False: the body ends without one; `completion_tokens`
    reported instead of the stub's; `pause`: after the first piece, wait for this Event;
    `break_after`: close the connection after that many pieces; `content_type` of the answer
    (bench/gateway.py labels it text/event-stream, which bench/passthrough.py's floors relay
    chunk by chunk rather than read whole). A position's entries are
    made here once (in the caller's thread, before any measure of memory) and sent for every
    position."""
    entries = []
    for token in range(vocab):
        word = LARGE_TOKENS[token % len(LARGE_TOKENS)]
        entry = {"logprob": -(token % 997) / 31.0 - 0.5, "rank": token + 1, "decoded_token": word}
        text = json.dumps(entry, ensure_ascii=False, separators=(",", ":"))
        entries.append(f"{json.dumps(str(token))}:{text}")
    position = ("{" + ",".join(entries) + "}").encode()
    return {
        "position": position,
        "shape": shape,
        "chunk": chunk,
        "extras": extras or {},
        "usage": usage,
        "pause": pause,
        "break_after": break_after,
        "content_type": content_type,
        **({"completion_tokens": completion_tokens} if completion_tokens is not None else {}),
    }


VLLM_TOP_EXTRAS = ("service_tier", "system_fingerprint")
VLLM_TAIL_EXTRAS = ("kv_transfer_params", "ec_transfer_params", "metrics")


def large_body(
    large: dict, header: dict, counts: list[int], n: int, max_tokens: int, usage, payload
):
    """The pieces (bytes) of `large_mode`'s answer, generated lazily: prompts of `counts`
    tokens, `n` choices each."""
    vllm = large["shape"] == "vllm"
    extras = large["extras"]
    token_ids = bool(payload.get("return_token_ids"))

    def value(name, default=None):
        return json.dumps(extras.get(name, default), separators=(",", ":")).encode()

    yield json.dumps(header, separators=(",", ":")).encode()[:-1] + b',"choices":['
    for index, count in enumerate(c for c in counts for _ in range(n)):
        ids = list(range(count))
        yield b"," if index else b""
        yield b'{"index":%d,"text":"%s","logprobs":null,"finish_reason":"length",' % (
            index,
            b" tok" * max_tokens,
        )
        yield b'"stop_reason":null,'
        if vllm:
            yield (
                b'"token_ids":'
                + (value("token_ids", [1] * max_tokens) if token_ids else b"null")
                + b","
            )
        yield b'"prompt_logprobs":[null'
        for _ in range(count - 1):
            yield b","
            yield large["position"]
        yield b"]"
        if vllm:
            yield b',"prompt_token_ids":' + (json.dumps(ids).encode() if token_ids else b"null")
            yield b',"routed_experts":' + value("routed_experts")
        elif token_ids:
            yield b',"prompt_token_ids":' + json.dumps(ids).encode() + b',"token_ids":[1]'
        yield b"}"
    yield b"]"
    if vllm:
        for name in VLLM_TOP_EXTRAS:
            yield b',"%s":%s' % (name.encode(), value(name))
    if large["usage"]:
        usage = (
            {**usage, "prompt_tokens_details": extras.get("prompt_tokens_details")}
            if vllm
            else usage
        )
        yield b',"usage":' + json.dumps(usage, separators=(",", ":")).encode()
    if vllm:
        for name in VLLM_TAIL_EXTRAS:
            yield b',"%s":%s' % (name.encode(), value(name))
    yield b"}"


async def _send_large(send, receive, large: dict, pieces) -> None:
    """Send `pieces` as one body in chunks of about large["chunk"] bytes, stopping when the
    client goes away."""
    gone = asyncio.Event()

    async def watch():
        while receive is not None and (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch()) if receive is not None else None
    raw_headers = [(b"content-type", large["content_type"].encode())]
    await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
    size, sent, pending = large["chunk"], 0, []
    pending_bytes = 0
    try:
        for piece in pieces:
            view = memoryview(piece)
            while view:
                take = view[: size - pending_bytes]
                view = view[len(take) :]
                pending.append(bytes(take))
                pending_bytes += len(take)
                if pending_bytes < size:
                    continue
                if gone.is_set():
                    return
                await send(
                    {"type": "http.response.body", "body": b"".join(pending), "more_body": True}
                )
                pending, pending_bytes, sent = [], 0, sent + 1
                if large["break_after"] is not None and sent >= large["break_after"]:
                    raise ConnectionAbortedError("stub breaks its answer off")
                while sent == 1 and large["pause"] is not None and not large["pause"].is_set():
                    await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"".join(pending)})
    finally:
        if watcher is not None:
            watcher.cancel()


def _logprobs(mode: dict, tokens: int) -> dict | None:
    if "logprob" not in mode:
        return None
    value = mode["logprob"]
    return {
        "tokens": [" tok"] * tokens,
        "token_logprobs": [value] * tokens,
        "top_logprobs": [{" tok": value}] * tokens,
        "text_offset": [4 * i for i in range(tokens)],
    }


async def _frame(send, payload):
    body = b"data: " + json.dumps(payload).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _raw(send, content: bytes, status: int = 200, headers=None):
    raw_headers = [(b"content-type", b"application/json")]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": content})


async def _json(send, payload, status=200, headers=None):
    await _raw(send, json.dumps(payload).encode(), status, headers)
