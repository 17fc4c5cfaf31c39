"""Draft-head training: a small head learns a frozen target's own greedy choices (self-distillation).

For every position p of the training text the target gives its final hidden state h_p and its
greedy choice g_p; the head, fed h_p and the text's token at p+1, must name g_{p+1} (and
predict h_{p+1}); then, fed its own hidden state and the token at p+2, g_{p+2}; and so on for
``draft_steps`` steps. Labels are the target's choices, not the text, because acceptance in
speculative decoding measures agreement with the target. The head's output covers the
``draft_vocab`` tokens most frequent in the training targets; choices outside it are skipped.

Only the head is the trained module: the trainer's optimizer, checkpoints and final save see
the head alone, while the target stays frozen beside it (``DraftHead.target``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from astrai.errors import ConfigError, DataError
from astrai.model.draft_head import DraftHead
from astrai.parallel.wrap import unwrap_model
from astrai.trainer.strategies.base import IGNORE_INDEX, BaseStrategy, StrategyFactory
from astrai.trainer.strategies.masks import model_inputs

OPTIONS = {"draft_vocab": 4096, "hidden_dim": None, "draft_steps": 3, "feature_weight": 1.0}
VOCAB_SAMPLE_ITEMS = 4096  # training samples read (evenly spread) to rank the draft vocabulary
ARGMAX_ROWS = 1024         # target lm_head rows per chunk when taking its greedy choices


def draft_options(strategy_kwargs: dict) -> dict:
    """The draft-head settings of ``strategy_kwargs`` with defaults, checked."""
    unknown = sorted(set(strategy_kwargs) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"TrainConfig.strategy_kwargs: {', '.join(unknown)} unknown to draft_head training; "
                          f"it takes {', '.join(OPTIONS)}")
    options = {**OPTIONS, **strategy_kwargs}
    for name in ("draft_vocab", "draft_steps") + (("hidden_dim",) if options["hidden_dim"] is not None else ()):
        value = options[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"TrainConfig.strategy_kwargs.{name}: must be a positive integer (got {value!r})")
    if not isinstance(options["feature_weight"], (int, float)) or options["feature_weight"] < 0:
        raise ConfigError("TrainConfig.strategy_kwargs.feature_weight: must be >= 0 "
                          f"(got {options['feature_weight']!r})")
    return options


def frequent_tokens(dataset: Dataset, count: int, vocab_size: int) -> torch.Tensor:
    """Ids of the ``count`` most frequent training targets (loss-masked ones only), ascending;
    ties go to the lower id, so the same data always gives the same vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    stride = max(1, len(dataset) // VOCAB_SAMPLE_ITEMS)
    for index in range(0, len(dataset), stride):
        item = dataset[index]
        if "target_ids" not in item:
            raise DataError("draft_head training reads text samples (input_ids, target_ids): preprocess the data "
                            "as 'seq' or 'sft'")
        targets = torch.as_tensor(item["target_ids"]).reshape(-1)
        if "loss_mask" in item:
            targets = targets[torch.as_tensor(item["loss_mask"]).reshape(-1).bool()]
        targets = targets[(targets >= 0) & (targets < vocab_size)]
        counts += torch.bincount(targets, minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:min(count, vocab_size)].sort().values


@torch.no_grad()
def greedy_choices(target: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The target's argmax token at every position, a chunk of rows at a time (a whole batch of
    full-vocabulary logits would be the run's largest tensor)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    picks = [target.lm_head(rows).argmax(dim=-1) for rows in flat.split(ARGMAX_ROWS)]
    return torch.cat(picks).reshape(hidden.shape[:-1])


@StrategyFactory.register("draft_head")
class DraftHeadStrategy(BaseStrategy):
    """Cross-entropy of each draft step against the target's choice, plus ``feature_weight`` ×
    smooth-L1 between the head's hidden states and the target's (EAGLE's regression term)."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", **kwargs: Any):
        options = draft_options(kwargs)
        super().__init__(model, device, **options)
        self.head: DraftHead = unwrap_model(model)
        if not isinstance(self.head, DraftHead):
            raise ConfigError("draft_head training trains a DraftHead; build the run with TrainContextBuilder "
                              "(astrai train --train_type draft_head --param_path TARGET)")
        self.target = self.head.target.to(self.device)
        self.draft_steps = options["draft_steps"]
        self.feature_weight = float(options["feature_weight"])

    @classmethod
    def module_to_train(cls, model: nn.Module, train_data: Dataset, config: Any) -> nn.Module:
        """A fresh head for the loaded model, which becomes its frozen target."""
        options = draft_options(config.strategy_kwargs)
        if not hasattr(model, "embed_tokens") or not hasattr(model, "lm_head"):
            raise ConfigError("draft_head training needs an astrai Transformer as its target (param_path)")
        model.eval()
        for param in model.parameters():
            param.requires_grad_(False)
        draft_ids = frequent_tokens(train_data, options["draft_vocab"], model.config.vocab_size)
        return DraftHead.for_target(model, draft_ids, options["hidden_dim"])

    def draft_labels(self, greedy: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Target ids → rows of the head's output, IGNORE_INDEX outside the draft vocabulary or the loss mask."""
        table = torch.full((self.head.config.vocab_size,), IGNORE_INDEX, dtype=torch.long, device=greedy.device)
        table[self.head.draft_ids] = torch.arange(self.head.draft_ids.numel(), device=greedy.device)
        labels = table[greedy]
        if loss_mask is not None:
            labels = labels.masked_fill(~loss_mask.to(device=labels.device, dtype=torch.bool), IGNORE_INDEX)
        return labels

    def compute_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if "input_ids" not in batch:
            raise DataError("draft_head batch has no 'input_ids'; train it on 'seq' or 'sft' data")
        batch = self.to_device(batch)
        ids = batch["input_ids"]
        with torch.no_grad():
            target_hidden = self.target(**model_inputs(batch), compute_logits=False)["hidden_states"]
            labels = self.draft_labels(greedy_choices(self.target, target_hidden), batch.get("loss_mask"))
        target_hidden = target_hidden.to(self.head.out_proj.weight.dtype)
        length = ids.shape[1]
        hidden, losses = target_hidden, []
        for step in range(1, min(self.draft_steps, length - 1) + 1):
            hidden, scores = self.model(hidden[:, :length - step], ids[:, step:])
            step_labels = labels[:, step:]
            valid = step_labels != IGNORE_INDEX
            ce = F.cross_entropy(scores.flatten(0, 1).float(), step_labels.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum") / valid.sum().clamp(min=1)
            feature = F.smooth_l1_loss(hidden.float(), target_hidden[:, step:].float())
            losses.append(ce + self.feature_weight * feature)
            hits = (scores.argmax(dim=-1) == step_labels) & valid
            self.metrics[f"acc_{step}"] = hits.sum() / valid.sum().clamp(min=1)
        return torch.stack(losses).mean()
