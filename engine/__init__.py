"""The RL job: entry point, configuration, trainer loop, model roles, rollout, rewards, data, checkpoints."""

from engine.startup import quiet_megatron_warnings

quiet_megatron_warnings()
