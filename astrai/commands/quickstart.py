"""``astrai quickstart``'s flags (the run: astrai/quickstart/cli.py)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None,
                        help="output directory (default: runs/quickstart, with --base runs/quickstart-base)")
    parser.add_argument("--minutes", type=float, default=15.0, help="time budget for the whole run (default 15)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the data order, initial weights and generated task data (default 0)")
    parser.add_argument("--plan", default=None, metavar="FILE",
                        help="pin the optimizer steps of each stage to this file (an earlier run's plan.json): "
                             "the same seed and plan give the same numbers (default: sized from measured throughput)")
    parser.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                        help="pre-training's and SFT's precision: fp32, bf16 autocast over fp32 weights, or auto, "
                             "the faster in a probe of both where the CPU has fast bf16 matmuls (default auto)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="tokenizer vocabulary (default 4096)")
    parser.add_argument("--corpus", default="auto",
                        help="pre-training text: auto (the large corpus when built, else the bundled sample), "
                             "bundled, or a corpus directory (default auto)")
    parser.add_argument("--base", default=None, metavar="PATH",
                        help="start from a pretrained model instead of from scratch: a Hugging Face model directory, "
                             "a GGUF file (Llama/Qwen2/Qwen3/Mistral) or 'smollm2' (installed by scripts/setup.sh); "
                             "skips the tokenizer and pre-training (docs/quickstart.md)")
    parser.add_argument("--finetune", default=None, choices=("full", "lora"),
                        help="with --base: fine-tune every weight or train LoRA adapters (default full)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in CI logs)")
