"""SEQ/SFT losses against hand computations; masked tokens get no gradient; packing isolation."""

import math

import pytest
import torch
from trainer_helpers import VOCAB, tiny_model

from astrai.config import preset
from astrai.errors import ConfigError
from astrai.model import AutoModel
from astrai.trainer import StrategyFactory


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a parameter, so gradients per position are visible."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, input_ids, input_mask=None, position_ids=None):
        return {"logits": self.logits}


def hand_cross_entropy(logits, targets, smoothing=0.0, keep=None):
    total, count = 0.0, 0
    B, T, V = logits.shape
    for b in range(B):
        for t in range(T):
            if keep is not None and not keep[b, t]:
                continue
            row = logits[b, t].tolist()
            m = max(row)
            log_z = m + math.log(sum(math.exp(x - m) for x in row))
            logp = [x - log_z for x in row]
            nll = -logp[targets[b, t]]
            uniform = -sum(logp) / V
            total += (1 - smoothing) * nll + smoothing * uniform
            count += 1
    return total / count


def test_seq_loss_matches_hand_computation_with_label_smoothing():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "target_ids": targets}
    for smoothing in (0.0, 0.1):
        strategy = StrategyFactory.create(FixedLogits(logits), "seq", "cpu", label_smoothing=smoothing)
        assert strategy(batch).item() == pytest.approx(hand_cross_entropy(logits, targets, smoothing), rel=1e-5)
        assert strategy.count_loss_units(batch) == 10


def test_sft_loss_counts_only_masked_tokens_and_masked_tokens_get_no_gradient():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 9)
    targets = torch.randint(0, 9, (2, 6))
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]])
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "target_ids": targets, "loss_mask": loss_mask}
    model = FixedLogits(logits)
    strategy = StrategyFactory.create(model, "sft", "cpu")
    loss = strategy(batch)
    assert loss.item() == pytest.approx(hand_cross_entropy(logits, targets, keep=loss_mask.bool()), rel=1e-5)
    assert strategy.count_loss_units(batch) == 5
    loss.backward()
    grad_norm_per_pos = model.logits.grad.abs().sum(-1)
    assert torch.all(grad_norm_per_pos[loss_mask == 0] == 0)
    assert torch.all(grad_norm_per_pos[loss_mask == 1] > 0)


def test_sft_document_mask_isolates_packed_conversations():
    model = tiny_model().eval()
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, VOCAB, (1, 5), generator=gen), torch.randint(0, VOCAB, (1, 7), generator=gen)
    packed = torch.cat([a, b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    positions = torch.tensor([list(range(5)) + list(range(7))])
    targets = torch.randint(0, VOCAB, (1, 12), generator=gen)
    mask = torch.tensor([[0] * 5 + [1] * 7])
    strategy = StrategyFactory.create(model, "sft", "cpu")
    packed_loss = strategy({"input_ids": packed, "target_ids": targets, "loss_mask": mask, "doc_ids": doc_ids,
                            "position_ids": positions})
    alone_loss = strategy({"input_ids": b, "target_ids": targets[:, 5:], "loss_mask": mask[:, 5:]})
    assert packed_loss.item() == pytest.approx(alone_loss.item(), abs=1e-5)
    leaky = strategy({"input_ids": packed, "target_ids": targets, "loss_mask": mask, "position_ids": positions})
    assert abs(leaky.item() - alone_loss.item()) > 1e-4


def test_moe_aux_loss_is_added_in_training():
    torch.manual_seed(0)
    model = AutoModel.from_config(preset("tiny-moe", vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         dim_ffn=64, moe_dim_ffn=16, max_len=64, aux_loss_coef=0.5))
    batch = {"input_ids": torch.randint(0, VOCAB, (2, 8)), "target_ids": torch.randint(0, VOCAB, (2, 8))}
    strategy = StrategyFactory.create(model, "seq", "cpu")
    loss = strategy(batch)
    out = model(batch["input_ids"])
    ce = torch.nn.functional.cross_entropy(out["logits"].flatten(0, 1), batch["target_ids"].flatten())
    assert out["aux_loss"].item() > 0
    assert loss.item() == pytest.approx((ce + out["aux_loss"]).item(), rel=1e-5)


def test_unknown_train_type_is_a_config_error():
    with pytest.raises(ConfigError, match="train_type"):
        StrategyFactory.create(tiny_model(), "nope", "cpu")


def test_a_user_registered_strategy_trains_and_an_unknown_name_is_refused(tmp_path):
    """training.md's "Writing a strategy": a registered name is a valid train_type; an
    unregistered one is refused before training with the registry's names."""
    from trainer_helpers import TokenWindows, config

    from astrai.trainer import Trainer
    from astrai.trainer.strategies import BaseStrategy

    calls = []

    @StrategyFactory.register("test_mean_logit")
    class MeanLogit(BaseStrategy):
        def compute_loss(self, batch):
            calls.append(1)
            return self.model(batch["input_ids"].to(self.device))["logits"].float().pow(2).mean()

    context = Trainer(config(tmp_path / "custom", train_type="test_mean_logit", max_steps=2, save_final_model=False),
                      model=tiny_model(), train_dataset=TokenWindows(n=16)).train()
    assert context.step == 2 and len(calls) == 2
    with pytest.raises(ConfigError, match="TrainConfig.train_type: choose one of .* or a registered strategy"):
        config(tmp_path / "bad", train_type="not_registered", max_steps=2).validate()
