"""``astrai serve --model DIR``: the HTTP server's command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from astrai.errors import ConfigError
from astrai.inference.cli import add_placement_arguments
from astrai.inference.placement import resolve_placement

from .application import DEFAULT_MAX_BODY_BYTES
from .runner import API_KEY_ENV


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory (config.json, model.safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None,
                      help=f"require this key on /v1 routes (shows in `ps`: prefer --api-key-file or ${API_KEY_ENV}; "
                           f"default: ${API_KEY_ENV} if set, else no key)")
    keys.add_argument("--api-key-file", default=None, metavar="PATH",
                      help="read the key from this file's first line (kept out of the process list)")
    parser.add_argument("--allowed-hosts", action="append", default=None, metavar="NAME[,NAME]",
                        help="Host header names to answer (repeatable; '*' any, '*.example.com' subdomains). Default: "
                             "the bound address and localhost; any host when bound to 0.0.0.0 with an API key")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: directory name)")
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
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def read_api_key_file(path: str) -> str:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ConfigError(f"--api-key-file {path}: the first line is empty; write the key there")
    return key


def split_names(values: Optional[list[str]]) -> Optional[list[str]]:
    """Repeated and comma-separated flag values, as one list (None when not given)."""
    names = [n.strip() for v in values or [] for n in v.split(",") if n.strip()]
    return names or None


def run(args: argparse.Namespace) -> int:
    from .runner import run_server

    for flag in ("port", "max_body_bytes", "default_max_tokens", "max_batch_size", "page_size", "max_queue"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    device, dtype = resolve_placement(args.device, args.dtype)
    api_key = read_api_key_file(args.api_key_file) if args.api_key_file else args.api_key
    run_server(args.model, host=args.host, port=args.port, api_key=api_key, model_name=args.served_model_name,
               cors_origins=args.cors_origin, allowed_hosts=split_names(args.allowed_hosts), max_body_bytes=args.max_body_bytes,
               default_max_tokens=args.default_max_tokens, log_level=args.log_level,
               max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, max_prompt_len=args.max_prompt_len,
               page_size=args.page_size, num_pages=args.num_pages, max_queue=args.max_queue,
               prefix_cache=not args.no_prefix_cache, device=device, dtype=dtype,
               quantize=args.quantize)
    return 0
