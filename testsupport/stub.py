"""A zero-latency vLLM-like upstream (raw ASGI, run by uvicorn in a thread) for gateway tests
and the gateway benchmark. Its behaviour is switched through `StubUpstream.mode`."""

import asyncio
import json

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
    `{"id", "object": "model", "max_model_len", ...}`; without it, GET /v1/models is a 404)."""

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
            await self.completions(json.loads(body), send)
        else:
            await _json(send, {"error": {"code": "not_found", "message": path}}, 404)

    async def completions(self, payload, send):
        self.requests.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self._completions(payload, send)
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

    async def _completions(self, payload, send):
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
