"""The embedded engine as a server with SGLang's HTTP API:

    python -m megarl.rollout.serve --model-path HF_DIR [--host 127.0.0.1 --port 30000] [--api-key KEY]

What the SGLang fleet launches with `rollout.sglang.server=embedded` (CPU runs, CI), with
the same flags as `python -m sglang.launch_server` for the ones both have. With `--api-key`
(or MEGARL_ENGINE_API_KEY in the environment, which keeps it off the command line) every
route but the health checks requires `Authorization: Bearer KEY`, as SGLang's does. Main
entry point: `main`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megarl.http_auth import ENGINE_KEY_ENV


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megarl.rollout.serve",
                                     description="megarl's embedded engine behind SGLang's native HTTP API.")
    parser.add_argument("--model-path", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-running-requests", type=int, default=64, help="sequences decoded together")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="record every token's experts (a mixture of experts) for requests that ask (as SGLang's)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on every route but /health* (as SGLang's "
                        f"--api-key); default: ${ENGINE_KEY_ENV}, else no key")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvicorn

    from megarl.rollout.http import create_engine_app
    from megarl.rollout.local import LocalEngine

    try:
        engine = LocalEngine.from_pretrained(args.model_path, dtype=args.dtype, max_batch_size=args.max_running_requests,
                                             seed=args.random_seed,
                                             record_routing=args.enable_return_routed_experts)
    except OSError as e:
        print(f"megarl serve: cannot load {args.model_path}: {e}", file=sys.stderr)
        return 1
    api_key = args.api_key or os.environ.get(ENGINE_KEY_ENV) or None
    app = create_engine_app(engine, engine.tokenizer, model_path=args.model_path, api_key=api_key)
    print(f"megarl serve: {args.model_path} on http://{args.host}:{args.port}"
          f"{' (API key required)' if api_key else ''}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
