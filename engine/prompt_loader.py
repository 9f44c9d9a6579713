"""Per-DP-rank batches of prompts (`PromptLoader`), from the records engine/data.py loads.

This module knows nothing about process groups: the caller passes its DP rank and size, and every rank
computes the same global batch from (seed, epoch, position), then takes its consecutive share.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from engine.data import PromptRecord
from engine.errors import DataError


class PromptLoader:
    """Endless, deterministic batches of prompts; each DP rank gets its consecutive share of each mini-batch's
    slice of the global batch (the whole batch with one mini-batch), so mini-batches do not depend on DP.

    Epoch e visits the records in the order of a permutation seeded by (seed, e) (identity if not
    shuffling), batch_size at a time; the incomplete tail is dropped, then epoch e+1 starts. The state
    (epoch, position) resumes exactly at the next batch.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        batch_size: int,
        seed: int,
        dp_rank: int,
        dp_size: int,
        shuffle: bool = True,
        num_mini_batches: int = 1,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if batch_size < 1 or batch_size % dp_size:
            raise DataError(
                f"data.batch_size={batch_size} must be a positive multiple of the data-parallel size {dp_size} "
                f"(dp = world / (tp * pp)); use e.g. data.batch_size={max(1, batch_size // dp_size) * dp_size}"
            )
        if num_mini_batches < 1 or batch_size % (dp_size * num_mini_batches):
            raise ValueError(
                f"algorithm.num_mini_batches={num_mini_batches} must divide the prompts per DP rank "
                f"(data.batch_size / dp = {batch_size // dp_size}); pick a divisor"
            )
        if len(records) < batch_size:
            raise DataError(
                f"data.batch_size={batch_size} is larger than the dataset ({len(records)} prompts after "
                "filtering by data.max_prompt_len); lower data.batch_size or add data"
            )
        self.records = list(records)
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_mini_batches = num_mini_batches
        """The update's mini-batches per step: each rank's share is cut per mini-batch (see next_batch)."""
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    @property
    def epoch(self) -> int:
        """Epoch (0-based) of the batch last returned (0 before the first)."""
        return self._epoch

    @property
    def num_batches_per_epoch(self) -> int:
        return len(self.records) // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def next_global_batch(self) -> list[PromptRecord]:
        """The next batch_size prompts, the same on every rank."""
        if self._position >= self.num_batches_per_epoch:
            self._epoch, self._position = self._epoch + 1, 0
            self._order = self._permutation(self._epoch)
        start = self._position * self.batch_size
        self._position += 1
        return [self.records[i] for i in self._order[start : start + self.batch_size]]

    def next_batch(self) -> list[PromptRecord]:
        """This DP rank's batch_size // dp_size prompts of the next global batch: for each of the
        `num_mini_batches` consecutive slices of the global batch, this rank's consecutive share of it.

        The update cuts each rank's rows into consecutive mini-batches, so mini-batch i over all ranks is
        slice i of the global batch, whatever the DP size (with one mini-batch: consecutive shares)."""
        batch = self.next_global_batch()
        per_mini = self.batch_size // self.num_mini_batches
        share = per_mini // self.dp_size
        first = self.dp_rank * share
        return [r for i in range(0, self.batch_size, per_mini) for r in batch[i + first : i + first + share]]

    def tail_note(self) -> str | None:
        """What each epoch leaves out when batch_size does not divide the prompts (None when it does)."""
        left = len(self.records) % self.batch_size
        if not left:
            return None
        which = (
            "other ones each epoch (shuffled)"
            if self.shuffle
            else "always the same last ones (data.shuffle=false): they are never trained on"
        )
        return (
            f"data: an epoch is {self.num_batches_per_epoch} batches of data.batch_size={self.batch_size}: "
            f"{left} of the {len(self.records)} prompts are left out of each, {which}"
        )

    @functools.cached_property
    def fingerprint(self) -> str:
        """A hash of the records in order (index, data source, ground truth, prompt token ids): which data a
        saved position is a position in."""
        digest = hashlib.sha256()
        for r in self.records:
            digest.update(f"{r.index}\0{r.data_source}\0{r.ground_truth}\0".encode())
            digest.update(np.asarray(r.prompt_ids, dtype=np.int64).tobytes())
        return digest.hexdigest()[:16]

    def state_dict(self) -> dict[str, int | str]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "num_records": len(self.records),
            "batch_size": self.batch_size,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: Mapping[str, int | str]) -> None:
        """Continue at the saved position; refused when it would be a position in other data or another
        order (a changed seed, data.shuffle, batch size, or prompts: files, their contents, data.max_prompt_len,
        the tokenizer or its chat template). Checkpoints from before the shuffle and fingerprint keys skip
        those checks."""
        now = {
            "seed": self.seed,
            "shuffle": int(self.shuffle),
            "num_records": len(self.records),
            "batch_size": self.batch_size,
            "fingerprint": self.fingerprint,
        }
        changed = {
            key: (state[key], value) for key, value in now.items() if key in state and state[key] != value
        }
        if changed:
            raise DataError(
                f"cannot resume the prompt loader: (saved, now) differ for {changed} (fingerprint: a hash of the "
                "prompts). Its position would be a position in other data or another order. Fix: resume with the "
                "same trainer.seed, data.shuffle, data.batch_size, data.train_files (and contents), tokenizer and "
                "data.max_prompt_len; or, to train the checkpoint's weights on other data, export them "
                "(python -m engine.export CHECKPOINT OUT_DIR) and start a new run with model.path=OUT_DIR"
            )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self._epoch)
