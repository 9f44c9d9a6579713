"""Per-phase time of one GRPO step, ours versus TRL's GRPOTrainer, from scripts/bench/results/e2e_h200.json.

pip install matplotlib && python scripts/bench/plot_e2e.py   # writes scripts/bench/results/e2e_h200.png
"""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results")
PHASES = (("gen", "rollout (gen)"), ("update_actor", "actor update"), ("other", "reward, adv, reshard"))


def main() -> None:
    """One pair of bars per preset: ours (the fastest native run per GPU in `runs`) split by phase, TRL's whole
    step; in GPU-seconds per step (step time x GPUs), so that a 2-GPU run and a 1-GPU run compare per GPU."""
    data = json.load(open(os.path.join(HERE, "e2e_h200.json")))
    ours: dict[str, dict] = {}
    for r in data["runs"]:
        if "ours" in r and r["ours"].get("backend") == "native":
            best = ours.get(r["preset"])
            if best is None or r["ours"]["step_s"] * r["gpus"] < best["ours"]["step_s"] * best["gpus"]:
                ours[r["preset"]] = r
    trl = {r["preset"]: r for r in data["runs"] if r.get("system") == "trl_grpo"}
    presets = [p for p in ("qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b") if p in ours and p in trl]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels, x = [], 0
    colors = {"gen": "#4c72b0", "update_actor": "#dd8452", "other": "#8c8c8c"}
    for preset in presets:
        run = ours[preset]
        t, gpus = run["ours"]["timing"], run["gpus"]
        parts = {"gen": t["gen"], "update_actor": t["update_actor"]}
        parts["other"] = t["step"] - parts["gen"] - parts["update_actor"]
        bottom = 0.0
        for key, name in PHASES:
            ax.bar(x, parts[key] * gpus, bottom=bottom, color=colors[key], label=name if x == 0 else None)
            bottom += parts[key] * gpus
        ax.text(x, bottom + 0.5, f"{bottom:.1f}", ha="center")
        ax.bar(
            x + 1,
            trl[preset]["step_s"],
            color="#55a868",
            label="TRL GRPOTrainer (whole step)" if x == 0 else None,
        )
        ax.text(x + 1, trl[preset]["step_s"] + 0.5, f"{trl[preset]['step_s']:.1f}", ha="center")
        labels += [f"ours\n{preset}\n({gpus} GPU)", f"TRL\n{preset}\n(1 GPU)"]
        x += 3
    ax.set_xticks([i for i in range(x) if i % 3 != 2], labels, fontsize=8)
    ax.set_ylabel("GPU-seconds per GRPO step (H200)")
    ax.set_title("64 prompts x 8 responses, 256 + 512 tokens, bf16")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "e2e_h200.png"), dpi=110)


if __name__ == "__main__":
    main()
