"""TaskTable: which pages each task holds, and how much of it came from the prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    pages: list[int] = field(default_factory=list)
    cached: int = 0      # leading pages shared from the prefix cache
    recorded: int = 0
    copied: int = 0      # tokens after those copied from another task's pages


class TaskTable:
    def __init__(self, pad_page: int):
        self._entries: dict[str, _Entry] = {}
        self._pad_page = pad_page

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, task_id: str, page_table: list[int], cached: int, copied: int = 0) -> None:
        self._entries[task_id] = _Entry(list(page_table), cached, recorded=cached, copied=copied)

    def get(self, task_id: str) -> list[int]:
        return self._entries[task_id].pages

    def get_cached(self, task_id: str) -> int:
        return self._entries[task_id].cached

    def get_copied(self, task_id: str) -> int:
        return self._entries[task_id].copied

    def get_recorded(self, task_id: str) -> int:
        return self._entries[task_id].recorded

    def set_recorded(self, task_id: str, n_pages: int) -> None:
        self._entries[task_id].recorded = n_pages

    def pop(self, task_id: str) -> tuple[list[int], int]:
        entry = self._entries.pop(task_id)
        return entry.pages, entry.cached

    def task_ids(self) -> list[str]:
        return list(self._entries)

    def table_tensor(self, task_ids: list[str], device, min_width: int = 1) -> torch.Tensor:
        """[B, max_pages] page indices, rows padded with the sink page.

        A task that is no longer here (aborted while its step was being prepared) gets
        a row of sink pages: its writes land in the sink and its output is discarded.
        """
        missing = _Entry()
        rows = [self._entries.get(t, missing).pages for t in task_ids]
        width = max(min_width, max(len(r) for r in rows))
        pad = self._pad_page
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
