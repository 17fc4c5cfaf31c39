"""``astrai train``'s flags: every TrainConfig field, plus the alignment and LoRA settings
folded into ``strategy_kwargs`` (the run: astrai/commands/train_run.py)."""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import MISSING, fields

from astrai.config import TrainConfig

FIELD_HELP = {
    "train_type": "seq | sft | dpo | rm | grpo | kl | draft_head",
    "data_root_path": "training data (a storage file or directory from `astrai preprocess`)",
    "datasets": 'mixture as JSON: [{"path": "a", "rate": 0.7}, {"path": "b", "rate": 0.3, "type": "seq"}] '
                '(type: optional; pre-training text may be mixed into sft)',
    "param_path": "model directory (config.json [+ weights, tokenizer])",
    "model_preset": "build a fresh model from a preset (tiny, small, 1b, ...) instead of param_path",
    "model_overrides": 'ModelConfig fields as JSON, e.g. {"vocab_size": 1024}',
    "total_tokens": "token budget (overrides n_epoch)",
    "schedule": "cosine | sgdr | wsd | constant",
    "optimizer": "adamw | muon (Muon on 2-D hidden weights, AdamW on the rest)",
    "precision": "auto | fp32 | bf16 (bf16 autocast, fp32 master weights)",
    "nprocs": "processes to spawn locally (use torchrun for multi-node)",
    "parallel_mode": "ddp | fsdp (FSDP2 fully_shard)",
}

STRATEGY_FLAGS = {
    "beta": (float, "DPO β (default 0.1) / KL-stage β (default 0.1)"),
    "rpo_alpha": (float, "DPO: weight of the chosen answers' NLL added to the loss (RPO; default 0 = plain DPO)"),
    "ref_path": (str, "reference model directory for DPO/GRPO (default: a frozen copy of the starting weights)"),
    "reduction": (str, "mean | sum over pairs / responses"),
    "group_size": (int, "GRPO responses sampled per prompt (default 4, at least 2)"),
    "clip_eps": (float, "GRPO ratio clipping ε (default 0.2)"),
    "kl_coef": (float, "GRPO KL penalty coefficient (default 0.01)"),
    "sync_interval": (int, "GRPO: re-sync the reference to the policy every N steps (default 200, 0 = never)"),
    "weight_sync_interval": (int, "GRPO: refresh the rollout engine's weights every N steps (default 1)"),
    "reward": (str, "GRPO reward: arithmetic | package.module:function | reward-model directory"),
    "max_new_tokens": (int, "GRPO rollout length limit (default 64)"),
    "temperature": (float, "GRPO rollout sampling temperature (default 1.0)"),
    "estimate": (str, "kl: the stage penalty, exact (KL over the vocabulary, default) | nll_difference (spec 003's "
                      "policy NLL - reference NLL, which does not anchor)"),
}


def _flag_type(annotation: str):
    text = str(annotation)
    if "dict" in text or "list" in text:
        return json.loads
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file with TrainConfig fields (flags override it)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (parameters, tokens/step, steps, memory) and exit")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CKPT",
                        help="continue from a checkpoint directory (default: the latest under ckpt_dir)")
    hints = typing.get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        default = f.default if f.default is not MISSING else f.default_factory()
        help_text = f"{FIELD_HELP.get(f.name, '')} (default: {json.dumps(default)})".strip()
        if hints[f.name] is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            parser.add_argument(f"--{f.name}", type=_flag_type(hints[f.name]), default=argparse.SUPPRESS, help=help_text)
    add_alignment_arguments(parser)


def add_alignment_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("alignment (dpo, rm, grpo, kl) and LoRA")
    for name, (kind, help_text) in STRATEGY_FLAGS.items():
        group.add_argument(f"--{name}", type=kind, default=argparse.SUPPRESS, help=help_text)
    group.add_argument("--stage_tokens", type=_int_list, default=argparse.SUPPRESS,
                       help="kl: token budget per stage, e.g. 1000000,200000 (at least two stages)")
    group.add_argument("--stage_datasets", type=json.loads, default=argparse.SUPPRESS,
                       help='kl: one dataset mixture per stage as JSON, e.g. [[{"path": "a"}], [{"path": "b"}]]')
    group.add_argument("--lora_rank", type=int, default=argparse.SUPPRESS, help="train LoRA adapters of this rank")
    group.add_argument("--lora_alpha", type=float, default=argparse.SUPPRESS, help="LoRA scale α (default 2·rank)")
    group.add_argument("--lora_targets", type=_name_list, default=argparse.SUPPRESS,
                       help="projections to adapt (default q_proj,k_proj,v_proj,o_proj)")
