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
    data = json.load(open(os.path.join(HERE, "e2e_h200.json")))
    ours = {r["preset"]: r["ours"] for r in data["runs"] if "ours" in r and r.get("gpus", 1) == 1}
    trl = {r["preset"]: r for r in data["runs"] if r.get("system") == "trl_grpo"}
    presets = [p for p in ("qwen2_5_0_5b", "qwen2_5_1_5b") if p in ours and p in trl]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels, x = [], 0
    colors = {"gen": "#4c72b0", "update_actor": "#dd8452", "other": "#8c8c8c"}
    for preset in presets:
        t = ours[preset]["timing"]
        parts = {"gen": t["gen"], "update_actor": t["update_actor"]}
        parts["other"] = t["step"] - parts["gen"] - parts["update_actor"]
        bottom = 0.0
        for key, name in PHASES:
            ax.bar(x, parts[key], bottom=bottom, color=colors[key], label=name if x == 0 else None)
            bottom += parts[key]
        ax.text(x, bottom + 0.3, f"{bottom:.1f} s", ha="center")
        ax.bar(
            x + 1,
            trl[preset]["step_s"],
            color="#55a868",
            label="TRL GRPOTrainer (whole step)" if x == 0 else None,
        )
        ax.text(x + 1, trl[preset]["step_s"] + 0.3, f"{trl[preset]['step_s']:.1f} s", ha="center")
        labels += [f"ours\n{preset}", f"TRL\n{preset}"]
        x += 3
    ax.set_xticks([i for i in range(x) if i % 3 != 2], labels)
    ax.set_ylabel("seconds per GRPO step (1 H200)")
    ax.set_title("64 prompts x 8 responses, 256 + 512 tokens, bf16")
    ax.legend(loc="upper center", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "e2e_h200.png"), dpi=110)


if __name__ == "__main__":
    main()
