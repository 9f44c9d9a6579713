"""What a configuration implies beyond its typed values (engine/config.py): which forward passes and models a
step needs, and the response lengths the overlong penalty works in. Read by validation, setup and the step."""

from __future__ import annotations

from engine.config import AlgorithmConfig, RolloutConfig


def needs_old_log_prob_forward(
    alg: AlgorithmConfig, rollout_log_probs: bool = True, off_policy_steps: int = 0
) -> bool:
    """Whether a step runs the actor's old-log-prob forward: when the actor takes more than one optimizer step
    per batch (with a single on-policy step the old log-probs equal the current ones), or when the KL in the
    reward needs the policy's log-probs and the rollout's are not them: it returns none
    (`rollout.log_probs=false`; one forward costs less than vLLM charges for returning them, scripts/bench/
    README.md "Rollout"), or it generated with older weights (`trainer.off_policy_steps` > 0: the penalty
    would lag the policy by a step, as would the adaptive KL controller that reads it)."""
    stale_or_missing = not rollout_log_probs or off_policy_steps > 0
    return alg.ppo_epochs > 1 or alg.num_mini_batches > 1 or (alg.kl_in_reward and stale_or_missing)


def needs_reference(alg: AlgorithmConfig) -> bool:
    """Whether the run builds the frozen reference: a KL loss (algorithm.kl_loss_coef > 0) or kl_in_reward."""
    return alg.kl_loss_coef > 0 or alg.kl_in_reward


def max_response_tokens(rollout: RolloutConfig) -> int:
    """The most tokens of one response (where DAPO's overlong penalty ramps to): rollout.max_new_tokens, or under
    rollout.multi_turn the episode's max_total_tokens, tool tokens included (as verl's agent loop counts)."""
    return rollout.multi_turn.max_total_tokens if rollout.multi_turn.enable else rollout.max_new_tokens


def overlong_buffer_tokens(alg: AlgorithmConfig, max_new_tokens: int) -> int:
    """The overlong buffer in tokens: algorithm.overlong_buffer_len, else overlong_buffer_frac of max_new_tokens
    (`max_response_tokens`)."""
    if alg.overlong_buffer_len > 0 or alg.overlong_buffer_frac <= 0:
        return alg.overlong_buffer_len
    return max(1, int(alg.overlong_buffer_frac * max_new_tokens))
