"""Response lengths of a benchmark workload, drawn once per seed and given to every engine alike.

- `fixed`: every response is `max_len` tokens (the workload of the earlier tables).
- `long_tail`: RL-like: most responses finish early, a few run to the limit. Per prompt, a lognormal length
  with median `median_frac * max_len` and the spread that puts `frac_at_max` of the mass at or above
  `max_len` (sigma = ln(1 / median_frac) / z, z the standard normal quantile of 1 - frac_at_max), rounded and
  clipped to [1, max_len]. Defaults: median 0.25 x max, 5% of prompts at the max.
Engines enforce the lengths with per-request limits and EOS ignored (`SamplingParams.max_new_tokens_per_prompt`
here; vLLM's per-request `max_tokens`; TRL and verl through what their request options allow). A prompt's
n responses share its length, as vLLM's per-request limit does.
"""

from __future__ import annotations

import argparse
import math
from statistics import NormalDist

import numpy as np

KINDS = ("fixed", "long_tail")


def add_step_args(ap: argparse.ArgumentParser) -> None:
    """The options of one GRPO step's workload, the same names and defaults in every end-to-end script (e2e.py,
    trl_grpo.py, verl_grpo.py), so `run.sh compare` can give them to all of them."""
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--lengths", choices=KINDS, default="fixed", help="scripts/bench/workload.py")
    ap.add_argument("--seed", type=int, default=0, help="seed of the lengths and prompts")


def response_lengths(
    kind: str,
    num_prompts: int,
    max_len: int,
    seed: int = 0,
    median_frac: float = 0.25,
    frac_at_max: float = 0.05,
) -> list[int]:
    """One response length per prompt (see the module docstring); the same for the same arguments."""
    if kind == "fixed":
        return [max_len] * num_prompts
    if kind != "long_tail":
        raise ValueError(f"workload kind {kind!r}: expected one of {KINDS}")
    if not (0 < median_frac < 1 and 0 < frac_at_max < 0.5):
        raise ValueError(
            f"long_tail needs 0 < median_frac < 1 and 0 < frac_at_max < 0.5, got {median_frac}, {frac_at_max}"
        )
    sigma = math.log(1 / median_frac) / NormalDist().inv_cdf(1 - frac_at_max)
    draws = np.random.default_rng(seed).lognormal(math.log(median_frac * max_len), sigma, num_prompts)
    return np.clip(np.rint(draws), 1, max_len).astype(int).tolist()


def describe(lengths: list[int], max_len: int) -> dict:
    """Summary figures of a length draw, for the benchmark's JSON."""
    a = np.asarray(lengths)
    return {
        "mean": round(float(a.mean()), 1),
        "median": float(np.median(a)),
        "p90": float(np.percentile(a, 90)),
        "max": int(a.max()),
        "frac_at_max": round(float((a >= max_len).mean()), 4),
        "total": int(a.sum()),
    }
