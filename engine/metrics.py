"""Step metrics: phase timers, and the loggers (console line, metrics.jsonl, tensorboard, wandb, progress bar).

Only the logging rank (global rank 0) writes; every key of the user-facing contract is produced by the
trainer, this module only formats and writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time

import torch


def run_header(cfg, dims, output_dir: str, warnings: list[str]) -> str:
    """The lines a run prints once (rank 0) when it starts: the presets (model.name, algorithm.name,
    cluster.name) and what they resolve to, the layout, the output directory, then `warnings` (one per line).
    `cfg`: engine.config.TrainConfig; `dims`: parallel.dims.ParallelDims."""
    m, a, r = cfg.model, cfg.algorithm, cfg.rollout
    lines = [
        f"run: model={m.name} ({m.path or 'random init'}) algorithm={a.name} (adv_estimator={a.adv_estimator}, "
        f"policy_loss={a.policy_loss}) cluster={cfg.cluster.name} ({cfg.cluster.device})",
        f"run: world {dims.world_size} = tp {dims.tp} x pp {dims.pp} x dp {dims.dp}; rollout {r.backend} tp {r.tp}; "
        f"{cfg.trainer.total_steps} steps of {cfg.data.batch_size} prompts x {r.n}; output_dir {output_dir}",
    ]
    return "\n".join(lines + list(warnings))


class PhaseTimer:
    """Wall-clock seconds per phase of a step (`timing/<phase>`), device-synchronised on GPU; on CUDA also
    the peak allocated memory of each phase (`perf/max_memory_allocated_gb/<phase>`: the peak statistics
    are reset when a phase starts, so a phase's number is its own peak, not the step's so far). Each phase is
    annotated `phase/<name>` for the profiler (engine/step_profiler.py)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self.peak_gb: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"phase/{name}"):  # trainer.profile_steps' traces
                yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                self.peak_gb[name] = max(self.peak_gb.get(name, 0.0), peak)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self.seconds.items()}
        out.update({f"perf/max_memory_allocated_gb/{k}": v for k, v in self.peak_gb.items()})
        return out


class MetricsLogger:
    """Writes one record per step to the configured sinks; a no-op on non-logging ranks."""

    def __init__(
        self, output_dir: str, loggers: list[str], enabled: bool, total_steps: int, progress_bar: bool
    ):
        self.enabled = enabled
        self.loggers = set(loggers)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if "jsonl" in self.loggers:
            self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", buffering=1)
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if "wandb" in self.loggers:
            import wandb

            self._wandb = wandb.init(dir=output_dir)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="rl steps", dynamic_ncols=True, leave=True)

    def resume_at(self, step: int) -> None:
        """Drop metrics.jsonl lines of steps after `step` (a crashed run logged them past its last checkpoint;
        the resumed run logs them again), so the file holds each step once; the progress bar starts there."""
        if self._bar is not None and step:
            self._bar.update(step)
        if self._jsonl is None:
            return
        path = self._jsonl.name
        self._jsonl.close()
        kept, unreadable = [], 0
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill (or a full disk) mid-write
                    unreadable += 1
                    continue
                if row.get("step", 0) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        if unreadable:
            print(
                f"metrics: dropped {unreadable} unreadable line(s) of {path} (cut by a kill mid-write)",
                flush=True,
            )
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        self._jsonl = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
        if self._tb:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if self._wandb:
            self._wandb.log(record, step=step)
        if "console" in self.loggers:
            line = _console_line(record)
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)
        if self._bar is not None and step > 0:  # step 0: validation before training
            self._bar.update(1)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


_CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_clipfrac", "clip", "{:.3f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("val/reward_mean", "val", "{:.3f}"),
    ("timing/step", "s/step", "{:.2f}"),
    ("perf/tokens_per_s_per_gpu", "tok/s/gpu", "{:.0f}"),
)


def _console_line(record: dict) -> str:
    parts = [f"step {record['step']:>4}"]
    for key, short, fmt in _CONSOLE_KEYS:
        if key in record and isinstance(record[key], (int, float)):
            parts.append(f"{short} {fmt.format(record[key])}")
    return " | ".join(parts)
