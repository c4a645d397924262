"""`python -m engine serve [--host 127.0.0.1] [--port 8001]`: run the embedded model server.
`python -m engine weights`: print where the model's weights are (vLLM serves the same files).

Both serve the model `ACS_ENGINE_MODEL` names (`engine.loader.MODEL_SPECS`), and refuse to
start with a name the engine does not know. The server refuses to listen beyond loopback
unless ACS_ENGINE_TOKEN is set (`config.bind_refusal`)."""

import argparse
import logging

import uvicorn

from engine.config import EngineConfig, bind_refusal
from engine.loader import UnknownModel, model_spec, weights_directory
from engine.server import create_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve the model over HTTP")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument("--log-level", default="info")
    commands.add_parser(
        "weights",
        help="print the directory of the model's weights and tokenizer (bfloat16 safetensors, "
        "config.json, tokenizer.json: what vLLM loads), converting them first if missing",
    )
    args = parser.parse_args()
    try:
        model_spec()
    except UnknownModel as error:
        parser.error(str(error))
    if args.command == "weights":
        print(weights_directory())
        return
    config = EngineConfig()
    if (refusal := bind_refusal(args.host, config)) is not None:
        parser.error(refusal)
    logging.basicConfig(level=args.log_level.upper())
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
