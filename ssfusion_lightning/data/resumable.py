"""A DataLoader that Lightning can resume in the middle of an epoch.

Lightning restores a loader mid-epoch only when the loader has ``state_dict``/``load_state_dict``;
a plain DataLoader restarts its epoch and replays batches. This one remembers how many batches
of the current epoch were handed out and skips exactly those on resume (the sampler's order is a
function of its seed and epoch, so the skipped batches are the ones already trained on).
Lightning saves checkpoints between batches, when no batch is fetched ahead of the trainer.
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader


class ResumableDataLoader(DataLoader):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        self._yielded = 0
        return self._count(super().__iter__(), skip)

    def _count(self, iterator: Iterator[Any], skip: int) -> Iterator[Any]:
        # Skip lazily, on the first next(): Lightning creates the iterator before it sets the
        # sampler's epoch, and the sampler draws its order when first asked for a batch.
        for _ in range(skip):
            next(iterator)
            self._yielded += 1
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        # A finished epoch is complete: the next iteration starts a new epoch from its start.
        return {"consumed": 0 if self._yielded >= len(self) else self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = int(state["consumed"])
