"""The embedded model server: SmolLM2-135M-Instruct on CPU behind a vLLM-like HTTP API.

Run it with `python -m engine serve`; build the app in-process with `engine.server.create_app`.
"""
