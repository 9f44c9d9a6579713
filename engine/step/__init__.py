"""One RL step, phase by phase: rollout (with the weight transition), reward, dynamic sampling, experience,
advantages, losses, updates and the step's statistics. `engine/trainer.py` sequences these phases."""
