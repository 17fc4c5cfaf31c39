"""``astrai serve --model DIR``: what the HTTP server's command line does (its flags: astrai/commands/serve.py)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional

from astrai.errors import ConfigError
from astrai.inference.cli import speculative_settings
from astrai.inference.placement import resolve_placement

from . import launch

# directory names that say where a model sits in a run, not which model it is
GENERIC_NAME = re.compile(r"(final|model|models|latest|best|last|ckpt|checkpoints?|out|output|weights"
                          r"|(checkpoint|ckpt|step|epoch|iter)[-_]?\d+)", re.IGNORECASE)


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


def served_model_name(model: str) -> str:
    """The model id a client sends when ``--served-model-name`` is not given: a GGUF file's name
    without .gguf, else the directory's name, or the nearest parent's when the name only says
    where a run put it (runs/pt/final -> pt, runs/quickstart/model -> quickstart)."""
    path = Path(model).resolve()
    if path.is_file():
        return path.stem
    for part in (path, *path.parents):
        if part.name and not GENERIC_NAME.fullmatch(part.name):
            return part.name
    return path.name or "astrai"


def run(args: argparse.Namespace) -> int:
    for flag in ("port", "max_body_bytes", "default_max_tokens", "max_batch_size", "page_size", "max_queue"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    device, dtype = resolve_placement(args.device, args.dtype)
    api_key = read_api_key_file(args.api_key_file) if args.api_key_file else args.api_key
    name = args.served_model_name or served_model_name(args.model)
    print(f"astrai serve: {args.model} as model {name!r} on http://{args.host}:{args.port} "
          f"(clients send \"model\": \"{name}\"; --served-model-name changes it)", file=sys.stderr, flush=True)
    launch.run_server(args.model, host=args.host, port=args.port, api_key=api_key, model_name=name,
               cors_origins=args.cors_origin, allowed_hosts=split_names(args.allowed_hosts), max_body_bytes=args.max_body_bytes,
               metrics_public=args.metrics_public,
               default_max_tokens=args.default_max_tokens, log_level=args.log_level,
               max_batch_size=args.max_batch_size, max_seq_len=args.max_seq_len, max_prompt_len=args.max_prompt_len,
               page_size=args.page_size, num_pages=args.num_pages, max_queue=args.max_queue,
               prefix_cache=not args.no_prefix_cache, device=device, dtype=dtype,
               quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype, **speculative_settings(args))
    return 0
