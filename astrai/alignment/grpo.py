"""GRPOStrategy: group-relative policy optimisation, online (engine rollouts) or offline (stored rewards).

Online, each batch holds prompts only: the strategy samples ``group_size``
responses per prompt from the behaviour policy (the engine's copy of the weights),
scores them, normalises the rewards within each group into advantages and takes
the clipped surrogate with a squared-log-ratio penalty towards the frozen
reference. After each optimizer step ``after_optimizer_step`` refreshes the engine
every ``weight_sync_interval`` steps and re-syncs the reference every
``sync_interval`` steps (0 = never).

Offline, the batch already holds ``prompts`` (+ ``prompt_mask``), ``responses``,
``masks`` and ``rewards``, one response per row; rows with the same prompt form a
group, and no engine is needed.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Optional, Sequence

import torch
from torch import nn

from astrai.alignment.group_packing import model_max_len, packed_logprobs_and_aux, packed_rows
from astrai.alignment.losses import (REDUCTIONS, group_advantages, grpo_loss, keyed_group_advantages,
                                     shifted_logprobs_and_aux)
from astrai.alignment.reference import ReferenceModel, cpu_weights, frozen, load_weights, unwrap
from astrai.alignment.rewards import compute_rewards, resolve_reward
from astrai.alignment.rollout import EngineRollout, RolloutBatch, pack_sequences
from astrai.errors import ConfigError, DataError
from astrai.trainer.callbacks.base import TrainCallback
from astrai.trainer.strategies.base import BaseStrategy, StrategyFactory


def _rows(ids, mask: Optional[torch.Tensor] = None) -> list[list[int]]:
    """Token lists from a list of lists or a padded tensor (with an optional 1-on-real-token mask)."""
    if isinstance(ids, torch.Tensor):
        if mask is None:
            return [row.tolist() for row in ids]
        return [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return [list(map(int, row)) for row in ids]


@StrategyFactory.register("grpo")
class GRPOStrategy(BaseStrategy):
    """Spec defaults: group_size 4, clip_eps 0.2, kl_coef 0.01, sync_interval 200."""

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu", group_size: int = 4,
                 clip_eps: float = 0.2, kl_coef: float = 0.01, sync_interval: int = 200, reduction: str = "mean",
                 reward: Any = None, tokenizer: Any = None, rollout: Optional[EngineRollout] = None,
                 max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 weight_sync_interval: int = 1, ref_model: Optional[nn.Module] = None, ref_path: Optional[str] = None,
                 seed: int = 0, share_prompts: bool = True, **kwargs: Any):
        super().__init__(model, device, **kwargs)
        if not isinstance(group_size, int) or group_size < 2:
            raise ConfigError(f"group_size must be an integer >= 2 (advantages compare responses within a group), "
                              f"got {group_size!r}")
        if not 0 < clip_eps < 1:
            raise ConfigError(f"clip_eps must be in (0, 1), got {clip_eps!r}")
        if kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {kl_coef!r}")
        if kl_coef == 0 and (ref_path or ref_model is not None):
            raise ConfigError(f"a reference model ({'ref_path ' + repr(ref_path) if ref_path else 'ref_model'}) is only "
                              "used by the KL term, and kl_coef is 0: set kl_coef > 0 or drop the reference")
        if sync_interval < 0 or weight_sync_interval < 1:
            raise ConfigError(f"sync_interval must be >= 0 (0 = never) and weight_sync_interval >= 1, got "
                              f"{sync_interval!r} and {weight_sync_interval!r}")
        if reduction not in REDUCTIONS:
            raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
        self.group_size, self.clip_eps, self.kl_coef = group_size, float(clip_eps), float(kl_coef)
        self.sync_interval, self.weight_sync_interval, self.reduction = sync_interval, weight_sync_interval, reduction
        self.share_prompts = bool(share_prompts)
        # kl_coef 0 (DAPO, Dr. GRPO) needs no reference: none is built, and no step runs one
        self.reference = ReferenceModel(model, ref_model, ref_path) if self.kl_coef > 0 else None
        self.reward = None if reward is None else resolve_reward(reward, device=self.device)
        self.tokenizer = tokenizer
        self._rollout = rollout
        self._rollout_options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        # The behaviour policy lags the trained one when the engine is refreshed less often than every step;
        # its log-probs then come from a copy holding the engine's weights.
        self.behaviour = frozen(copy.deepcopy(unwrap(model))) if weight_sync_interval > 1 else None
        self.steps = 0
        self._requests_done = 0  # rollout requests before a resume (their count seeds the next ones)

    @property
    def ref_model(self) -> Optional[nn.Module]:
        return None if self.reference is None else self.reference.model

    @property
    def rollout(self) -> EngineRollout:
        if self._rollout is None:
            if self.tokenizer is None:
                raise ConfigError("online GRPO needs a tokenizer (for the engine and the reward); pass tokenizer=")
            # the engine samples with the behaviour policy: after a resume, the weights of the last refresh
            source = self.model if self.behaviour is None else self.behaviour
            self._rollout = EngineRollout.for_policy(source, self.tokenizer, **self._rollout_options)
            self._rollout.requests = self._requests_done
        return self._rollout

    def set_rollout_dtype(self, dtype: Optional[torch.dtype]) -> None:
        """The dtype of the engine's weight copy (None: the policy's); takes effect when the engine is built."""
        if self._rollout is None:
            self._rollout_options["dtype"] = dtype

    # --- one step ---------------------------------------------------------------
    def sample(self, prompts: Sequence[Sequence[int]], prompt_texts: Optional[Sequence[str]] = None) -> tuple[RolloutBatch, torch.Tensor, float]:
        """Roll out and score: (rollout, rewards [N], scoring seconds)."""
        if self.reward is None:
            raise ConfigError("online GRPO needs a reward: --reward arithmetic | package.module:function | <reward model dir>")
        rollout = self.rollout.generate(prompts, self.group_size, prompt_texts)
        start = time.perf_counter()
        rewards = compute_rewards(self.reward, rollout.prompt_texts, rollout.response_texts, rollout.input_ids,
                                  rollout.response_mask)
        return rollout, rewards, time.perf_counter() - start

    def policy_loss(self, input_ids: torch.Tensor, response_mask: torch.Tensor, rewards: torch.Tensor,
                    advantages: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The GRPO objective on scored sequences (consecutive groups unless ``advantages`` is given)."""
        if advantages is None:
            advantages = group_advantages(rewards, self.group_size)
        response_length = response_mask.sum(dim=1).float().mean()
        total_rows = len(advantages)
        if self.reference is None:
            # Without the KL term a row of advantage 0 adds exactly nothing to the loss or its
            # gradient (a group whose answers all scored alike): it is not run. One row is kept
            # when none is left, so every rank still runs a forward and a backward.
            keep = advantages != 0
            if not keep.any():
                keep[0] = True
            if not keep.all():
                rows = keep.to(input_ids.device)
                input_ids, response_mask, advantages = input_ids[rows], response_mask[rows], advantages[keep]
        advantages = advantages.to(self.device)
        score, mask = self.token_scorer(input_ids, response_mask)
        logp, aux = score(self.model)
        if self.behaviour is None:
            old_logp = logp.detach()
        else:
            with torch.no_grad():
                old_logp = score(self.behaviour)[0]
        ref_logp = None
        if self.reference is not None:
            with self.reference.active() as ref:
                ref_logp = score(ref)[0]
        loss, metrics = grpo_loss(logp, old_logp, ref_logp, advantages, mask, self.clip_eps, self.kl_coef,
                                  self.reduction)
        if self.reduction == "mean" and len(advantages) < total_rows:
            loss = loss * (len(advantages) / total_rows)  # the mean over every row, the left-out ones being 0
        self.metrics = {
            "grpo_loss": loss.detach(),
            "reward_mean": rewards.float().mean().item(),
            "reward_std": rewards.float().std(unbiased=False).item(),
            "response_length": response_length,
            "rows_scored": len(advantages) / total_rows,
            **metrics,
        }
        return self.add_aux_loss(loss, {"aux_loss": aux})

    def token_scorer(self, input_ids: torch.Tensor, response_mask: torch.Tensor):
        """(score, mask): ``score(model)`` gives (log-probs, aux loss) of the response tokens that
        ``mask`` marks. Rows sharing a prompt are packed into one (``group_packing``) when
        ``share_prompts`` is on and the packed row fits the model; otherwise each row runs whole."""
        packed = packed_rows(input_ids, response_mask, model_max_len(self.model)) if self.share_prompts else None
        if packed is not None:
            packed = packed.to(self.device)
            return (lambda model: packed_logprobs_and_aux(model, packed)), packed.mask
        ids = input_ids.to(self.device)
        return (lambda model: shifted_logprobs_and_aux(model, ids)), response_mask[:, 1:].to(self.device)

    def compute_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        if "prompts" not in batch:
            raise DataError("GRPO batch has no 'prompts'; load prompts (online) or prompts/responses/masks/rewards "
                            "(offline) with train_type 'grpo'")
        if "responses" in batch:
            return self.offline_loss(batch)
        prompts = _rows(batch["prompts"], batch.get("prompt_mask"))
        rollout, rewards, scoring_s = self.sample(prompts, batch.get("prompt_texts"))
        update_start = time.perf_counter()
        loss = self.policy_loss(rollout.input_ids, rollout.response_mask, rewards)
        self.metrics.update(rollout_s=rollout.seconds, scoring_s=scoring_s,
                            rollout_tokens_per_s=rollout.num_response_tokens / max(rollout.seconds, 1e-9),
                            forward_s=time.perf_counter() - update_start)
        return loss

    def offline_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        """Stored responses and rewards, one response per row (the layout of the GRPO dataset).

        Rows are grouped by identical prompt within the batch, so shuffled data still
        compares each response with its siblings; a prompt seen once gets advantage 0.
        """
        for key in ("masks", "rewards"):
            if key not in batch:
                raise DataError(f"offline GRPO batch has no {key!r}; expected prompts, responses, masks, rewards")
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32).flatten()
        if not torch.isfinite(rewards).all():
            bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
            raise DataError(f"offline GRPO batch: reward(s) at row(s) {bad} are not finite")
        prompts = _rows(batch["prompts"], batch.get("prompt_mask"))
        ids, response_mask = pack_sequences(prompts, _rows(batch["responses"], batch["masks"]))
        advantages = keyed_group_advantages(rewards, [tuple(p) for p in prompts])
        return self.policy_loss(ids, response_mask, rewards, advantages)

    # --- schedule ---------------------------------------------------------------
    def after_optimizer_step(self) -> None:
        """Refresh the engine (and behaviour copy) and, every ``sync_interval`` steps, the reference."""
        self.steps += 1
        if self.steps % self.weight_sync_interval == 0:
            if self._rollout is not None:
                self._rollout.update_weights(self.model)
            if self.behaviour is not None:
                load_weights(self.behaviour, unwrap(self.model).state_dict())
        if self.reference is not None and self.sync_interval and self.steps % self.sync_interval == 0:
            self.reference.sync()

    def callbacks(self) -> list:
        return [GRPOScheduleCallback(self)]

    def state_dict(self) -> dict[str, Any]:
        """The schedule position, the sampling seeds used, the reference and the behaviour weights."""
        requests = self._rollout.requests if self._rollout is not None else self._requests_done
        reference = self.reference.state_dict() if self.reference is not None else {}
        state: dict[str, Any] = {"steps": self.steps, "requests": requests, "reference": reference}
        if self.behaviour is not None:
            state["behaviour"] = cpu_weights(self.behaviour)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        self._requests_done = int(state.get("requests", 0))
        if self.reference is not None:
            self.reference.load_state_dict(state.get("reference", {}))
        if self.behaviour is not None and "behaviour" in state:
            load_weights(self.behaviour, state["behaviour"])
        if self._rollout is not None:
            self._rollout.requests = self._requests_done
            self._rollout.update_weights(self.behaviour if self.behaviour is not None else self.model)

    def close(self) -> None:
        """Stop the rollout engine's scheduler thread (the strategy can still compute offline losses)."""
        if self._rollout is not None:
            self._requests_done = self._rollout.requests
            self._rollout.close()
            self._rollout = None

    def mean_reward(self, prompts: Sequence[Sequence[int]], prompt_texts: Optional[Sequence[str]] = None) -> float:
        """Mean reward of fresh samples on ``prompts`` (for held-out evaluation; no gradients)."""
        _, rewards, _ = self.sample(prompts, prompt_texts)
        return rewards.mean().item()



def rollout_dtype(autocast_dtype: Optional[torch.dtype], device: torch.device) -> Optional[torch.dtype]:
    """Rollouts in the run's autocast dtype on a GPU, where bf16 weights halve the bytes each decoded token
    reads and use the tensor cores. On the CPU the engine keeps fp32: its hand-written decode kernels are
    fp32-only."""
    return autocast_dtype if torch.device(device).type == "cuda" else None


class GRPOScheduleCallback(TrainCallback):
    """Ties GRPO to the training loop: the run's tokenizer for rollouts, the weight/reference
    schedule after every optimizer step, and the engine thread stopped when the run ends."""

    def __init__(self, strategy: GRPOStrategy):
        self.strategy = strategy

    def on_train_begin(self, context) -> None:
        if self.strategy.tokenizer is None:
            self.strategy.tokenizer = context.tokenizer
        self.strategy.set_rollout_dtype(rollout_dtype(context.autocast_dtype, context.device))

    def on_step_end(self, context) -> None:
        self.strategy.after_optimizer_step()

    def on_train_end(self, context) -> None:
        self.strategy.close()

    def on_error(self, context) -> None:
        self.strategy.close()
