"""llama.cpp beside the engine, for `bench/engine.py --peer llama.cpp`; runs in .venv-bench
(`make bench-venv`), never in the engine's virtualenv.

`quantize SOURCE TARGET FTYPE`: llama.cpp's own requantisation of a GGUF file (F16 from the
shipped Q4_1). `serve MODEL THREADS`: loads MODEL, prints one JSON line with the CPU features
this build of llama.cpp uses, then answers each JSON request line on stdin with one JSON line
of measures, so that the bench can alternate them with the engine's.
"""

import ctypes
import json
import os
import sys
import time

import llama_cpp

FTYPES = {"F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16}


def quantize(source: str, target: str, ftype: str) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.allow_requantize = True
    staging = f"{target}.{os.getpid()}.partial"
    if llama_cpp.llama_model_quantize(source.encode(), staging.encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not make {ftype} from {source}")
    os.replace(staging, target)


def token_times(llm: llama_cpp.Llama, prompt_ids: list[int], tokens: int) -> list[float]:
    """Arrival time of each of `tokens` greedy tokens after `prompt_ids`, from a fresh context
    (no prefix reused), never stopping at an end-of-text token (as the engine's ignore_eos)."""
    llm.reset()
    times = []
    for _ in llm.generate(prompt_ids, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == tokens:
            break
    return times


def measure(llm: llama_cpp.Llama, decode_prompt: str, decode_tokens: int, ttft_ids: list[int]):
    times = token_times(llm, llm.tokenize(decode_prompt.encode(), special=True), decode_tokens)
    started = time.perf_counter()
    first = token_times(llm, ttft_ids, 1)[0]
    return {"decode": (len(times) - 1) / (times[-1] - times[0]), "ttft": first - started}


def serve(model: str, threads: int) -> None:
    llm = llama_cpp.Llama(
        model_path=model,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    print(json.dumps({"system_info": llama_cpp.llama_print_system_info().decode()}), flush=True)
    for line in sys.stdin:
        print(json.dumps(measure(llm, **json.loads(line))), flush=True)


if __name__ == "__main__":
    command, *arguments = sys.argv[1:]
    if command == "quantize":
        quantize(*arguments)
    else:
        serve(arguments[0], int(arguments[1]))
