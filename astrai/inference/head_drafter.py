"""HeadDrafter: speculative drafts from a draft head trained on the target's own outputs.

A draft head (astrai/model/draft_head.py, trained by ``astrai train --train_type draft_head``)
predicts the target's next tokens from the target's final hidden state and the token that
state chose. That hidden state comes free with every verify step (the runner returns it
beside the logits), so the head needs no model run and no cache of its own: after each
verify step the scheduler hands the drafter each row's hidden state at its last computed
position (``observe``), and the next step drafts from it; a prompt's step hands over the state
at the prompt's end the same way. A row without a fresh one (back from plain decoding) first
takes a verify step without drafts (``ready``).
Where the runner drafts with the head in C (``run_drafter``), a lone greedy row's verify steps and
drafts run several to one call, the state handed in and out once a run.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from astrai.model.draft_head import DraftHead


class HeadDrafter:
    """Drafts with ``head`` for every task it has a current hidden state of."""

    # A row stops drafting for a while when fewer of its drafted tokens are kept (the control's
    # floor is 0.3): a head's draft token costs about 1% of a target step and a verify step with
    # one more token little more, so kept tokens pay down to this share. On int8 SmolLM2 chat,
    # 24 prompts x 2, floors alternated in one process: 1.40, 1.50 and 1.63x plain at the median
    # against 1.16, 1.45 and 1.49x at 0.3 (never stopping: 1.31 and 1.30x).
    min_kept = 0.1

    def __init__(self, head: DraftHead):
        self.head = head
        self._state: dict[str, tuple[int, torch.Tensor]] = {}  # task → (its num_computed then, hidden state)
        self._fused = None  # one row's drafts in one call, where the runner offers it

    def prepare(self, runner) -> None:
        """Lay the head out as ``runner`` lays out the model it serves, so that a draft's few-row
        matmuls take the same kernels as a decode step's (on the CPU the C GEMV for one row,
        where torch's one-row matmul took several times as long), and take the runner's fused
        drafting of one row where it has one (the CPU's: every draft token in one C call)."""
        self.head = runner.prepare(self.head)
        fuse = getattr(runner, "fused_draft_head", None)
        self._fused = fuse(self.head) if fuse is not None else None

    def observe(self, task, hidden: torch.Tensor) -> None:
        """``hidden`` [dim]: the target's final hidden state at ``task``'s last computed position."""
        self._state[task.task_id] = (task.num_computed, hidden.detach().float().clone())

    def run_drafter(self, task):
        """What the runner's ``speculative_run`` drafts ``task``'s row with: the runner's fused drafting
        of one row (``prepare``), or None where it has none (verify steps then go one at a time)."""
        return self._fused

    def hidden(self, task) -> Optional[torch.Tensor]:
        """The state held for ``task`` when it is current (``ready``), else None."""
        return self._state[task.task_id][1] if self.ready(task) else None

    def ready(self, task) -> bool:
        """Whether the state held for ``task`` is at its current position (no plain step since)."""
        state = self._state.get(task.task_id)
        return state is not None and state[0] == task.num_computed

    @torch.inference_mode()
    def propose(self, tasks: Sequence, k: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in tasks]
        rows = [i for i, (task, wanted) in enumerate(zip(tasks, k)) if wanted > 0 and self.ready(task)]
        if not rows:
            return drafts
        if self._fused is not None and len(rows) == 1:
            task = tasks[rows[0]]
            drafts[rows[0]] = self._fused(self._state[task.task_id][1], task.context[task.num_computed], k[rows[0]])
            return drafts
        hidden = torch.stack([self._state[tasks[i].task_id][1] for i in rows])
        tokens = torch.tensor([tasks[i].context[tasks[i].num_computed] for i in rows])
        guesses = self.head.draft_batch(hidden, tokens, max(k[i] for i in rows))
        for i, guess in zip(rows, guesses):
            drafts[i] = guess[:k[i]]
        return drafts

    def forget(self, task_id: str) -> None:
        self._state.pop(task_id, None)
