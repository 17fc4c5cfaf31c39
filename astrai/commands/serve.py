"""``astrai serve``'s flags (the run: astrai/serving/cli.py)."""

from __future__ import annotations

import argparse

from astrai.commands.engine import add_placement_arguments, add_speculative_arguments

# astrai/serving/launch.py's API_KEY_ENV and application.py's DEFAULT_MAX_BODY_BYTES
API_KEY_ENV = "ASTRAI_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help=f"require this key on /v1 routes, /stats and /metrics (shows in `ps`: prefer --api-key-file or ${API_KEY_ENV}; "
                           f"default: ${API_KEY_ENV} if set, else no key)")
    keys.add_argument("--api-key-file", default=None, metavar="PATH",
                      help="read the key from this file's first line (kept out of the process list)")
    parser.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME]",
                        help="Host header names to answer (repeatable; '*' any, '*.example.com' subdomains). Default: "
                             "the bound address and localhost; any host when bound to 0.0.0.0 with an API key")
    parser.add_argument("--metrics-public", action="store_true",
                        help="answer /stats and /metrics without the API key (for a scraper that sends none)")
    parser.add_argument("--served-model-name", default=None,
                        help="model id clients send (default: the model directory's name, or its parent's when the "
                             "name is a generic one such as final, model or checkpoint-200; a GGUF file's name "
                             "without .gguf)")
    parser.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                        help="allow browser requests from this origin (repeatable; CORS is off by default)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest accepted request body (larger ones get 413)")
    parser.add_argument("--default-max-tokens", type=int, default=512,
                        help="completion length when a request gives no max_tokens")
    add_placement_arguments(parser)
    limits = parser.add_argument_group("engine limits")
    limits.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together")
    limits.add_argument("--max-seq-len", type=int, default=None, help="prompt + completion tokens per request")
    limits.add_argument("--max-prompt-len", type=int, default=None)
    limits.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page")
    limits.add_argument("--num-pages", type=int, default=None, help="KV-cache pages (default: sized by the engine)")
    limits.add_argument("--max-queue", type=int, default=256, help="waiting requests before 503 Overloaded")
    limits.add_argument("--no-prefix-cache", action="store_true", help="disable prompt prefix reuse")
    add_speculative_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
