"""The RL algorithm family as pure tensor functions: advantages, policy/value losses, KL, DAPO helpers.

Everything here is a function of tensors: no torch.distributed, no config objects. The per-micro-batch
functions (policy/value losses, agg_loss, KL estimators, entropy) never wait on the device; loss_normalizer
(returns a float) and the group-based estimators (torch.unique) do, once per batch.
Shapes: `_b` (batch,), `_bt` (batch, resp_len), `_btv` (batch, resp_len, vocab). `mask_bt` is 1/True on response tokens that count, 0 on padding (bool or 0/1 of any dtype);
padded positions may hold any finite garbage: every function ignores them and returns 0 there.
Unknown names and mismatched shapes raise ValueError naming the argument.

Advantages (algorithms/advantages.py). Names: gae, grpo, rloo, opo, reinforce_pp, reinforce_pp_baseline, remax.
    get_advantage_estimator(name) -> fn; advantage_estimator_names() -> list[str]
    fn(*, mask_bt, scores_b=None, group_index_b=None, token_rewards_bt=None, values_bt=None,
       baseline_scores_b=None, gamma=1.0, lam=1.0, norm_by_std=True, whiten=True, eps=1e-6,
       reduce_sum=None)
       -> (advantages_bt, returns_bt), both (batch, resp_len), zero on padding; runs under no_grad.
    Same signature for all; each uses what it needs and raises ValueError if that is None:
        gae                    token_rewards_bt, values_bt; gamma, lam, whiten (advantage whitening)
        grpo                   scores_b, group_index_b; norm_by_std (False = Dr.GRPO), eps
        rloo, opo, reinforce_pp_baseline   scores_b, group_index_b
        reinforce_pp           token_rewards_bt; gamma (always whitened)
        remax                  token_rewards_bt, baseline_scores_b (score of the greedy response to the same
                               prompt): reward-to-go minus baseline per token, as verl's remax
    scores_b (batch,) float: one reward per response (with KL in the reward: the sum over valid tokens of
    token_rewards_bt). group_index_b (batch,) int: prompt id per response; groups need not be adjacent,
    but a group must be entirely in the call. A group of one has no baseline (advantage = its score).
    returns_bt: critic target for gae (advantages + values, before whitening).
    Whitening (verl's masked_whiten) uses the statistics of the whole batch: call on the whole batch, or on
    each DP shard with reduce_sum (a function summing a tensor over the shards, e.g. an all_reduce over DP).

Losses (algorithms/losses.py). Policy loss names: ppo, gspo. Agg modes: LOSS_AGG_MODES =
    ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm").
    get_policy_loss(name) -> fn; policy_loss_names() -> list[str]
    fn(log_probs_bt, old_log_probs_bt, advantages_bt, mask_bt, *, loss_agg_mode, global_normalizer,
       clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, rollout_log_probs_bt=None, tis_cap=0.0,
       tis_mode="truncate") -> (loss 0-dim, metrics {"clipfrac", "clipfrac_lower", "approx_kl"[, "tis_weight_mean"]})
       (gspo's defaults are clip_ratio_low=3e-4, clip_ratio_high=4e-4; it ignores clip_ratio_c.)
       tis_cap > 0: each token loss times detached min(exp(old - rollout), tis_cap); needs rollout_log_probs_bt.
       tis_mode="mask": times exp(old - rollout) where that is <= tis_cap, else 0 (masked IS; TIS_MODES).
    loss_normalizer(mask_bt, loss_agg_mode, max_len=None) -> float: valid tokens (token-mean) or sequences
       with >= 1 valid token (seq-mean-*), times max_len for seq-mean-token-sum-norm (required there: a
       constant such as the rollout's max new tokens). Additive: global = SUM over DP ranks and micro-batches.
    agg_loss(loss_mat_bt, mask_bt, loss_agg_mode, global_normalizer) -> 0-dim: (masked sum, or for
       seq-mean-token-mean the sum of per-sequence token means) / global_normalizer. With the global
       normaliser of the whole mini-batch, shard losses ADD UP to the full-batch loss for any split along
       batch. (If the DP gradient reduction averages, multiply the loss by the DP size.)
    value_loss(values_bt, old_values_bt, returns_bt, mask_bt, *, loss_agg_mode, global_normalizer,
       value_clip=0.2) -> (0.5 * agg of clipped squared error, {"vf_clipfrac", "vpred_mean"}); value_clip 0 = off.
    entropy_from_logits(logits_btv, chunk_size=1024) -> entropy_bt (..., vocab) -> (...), >= float32;
       chunked, checkpointed under autograd; full vocab needed. Entropy bonus (by the caller):
       loss = pg_loss - entropy_coef * agg_loss(entropy_bt, mask_bt, mode, global_normalizer).
    Metrics are detached 0-dim tensors, means over this shard's valid tokens.

KL (algorithms/kl.py). Estimator names: k1, k2, k3, abs (k3 = verl's low_var_kl, clamped to [-10, 10]).
    get_kl_estimator(name) -> fn(log_probs_bt, ref_log_probs_bt, mask_bt) -> kl_bt (zero on padding)
    kl_estimator_names() -> list[str]
    KL loss term: kl_loss_coef * agg_loss(kl_bt, mask_bt, loss_agg_mode, global_normalizer).
    scores_to_token_rewards(scores_b, mask_bt, *, kl_bt=None, kl_coef=0.0) -> token_rewards_bt: score on
       the last valid token minus kl_coef * kl_bt on valid tokens (KL in the reward; also GAE's rewards).
    make_kl_controller(kind, *, kl_coef, target=0.1, horizon=10000) -> FixedKLController |
       AdaptiveKLController; kind in KL_CONTROLLERS = ("fixed", "adaptive"). Both have `.value` (the
       current coefficient), `update(current_kl, n_steps)` (once per step; current_kl = mean over sequences
       of the per-sequence token-mean KL, n_steps = number of sequences), state_dict()/load_state_dict().
       current_kl = agg_loss(kl_bt, mask_bt, "seq-mean-token-mean", loss_normalizer(mask_bt, "seq-mean-token-mean")).

DAPO (algorithms/dapo.py).
    dynamic_sampling_keep_mask(scores_b, group_index_b) -> keep_b bool (batch,): False for groups whose
       scores are all equal (singletons kept); the caller drops them and refills with new prompts.
    overlong_penalty(response_lengths_b, *, max_len, buffer_len, penalty_factor=1.0) -> (batch,) <= 0, to
       ADD to scores_b: 0 up to max_len - buffer_len, linear down to -penalty_factor at max_len.
       buffer_len 0 = off; buffer_len > max_len raises ValueError.

Wiring from the `algorithm` config (c), one step; lp/old_lp/ref_lp/rollout_lp are (batch, resp_len) log-probs:
    if c.overlong_buffer_len > 0: scores_b = scores_b + overlong_penalty(lengths_b, max_len=<rollout max
        new tokens>, buffer_len=c.overlong_buffer_len, penalty_factor=c.overlong_penalty)
    if c.dynamic_sampling: keep_b = dynamic_sampling_keep_mask(scores_b, group_index_b)  # refill, repeat
    ctrl = make_kl_controller(c.kl_ctrl, kl_coef=c.kl_reward_coef, target=c.kl_target, horizon=c.kl_horizon)  # once
    if c.kl_in_reward: kl_bt = get_kl_estimator(c.kl_estimator)(old_lp, ref_lp, mask_bt)
        token_rewards_bt = scores_to_token_rewards(scores_b, mask_bt, kl_bt=kl_bt, kl_coef=ctrl.value)
        scores_b = token_rewards_bt.sum(-1); ctrl.update(current_kl, n_steps=batch)  # current_kl over all of DP
    else: token_rewards_bt = scores_to_token_rewards(scores_b, mask_bt)
    adv_bt, ret_bt = get_advantage_estimator(c.adv_estimator)(mask_bt=..., scores_b=..., group_index_b=...,
        token_rewards_bt=..., values_bt=..., gamma=c.gamma, lam=c.lam, norm_by_std=c.norm_adv_by_std,
        reduce_sum=<sum over DP>)   # whitening over the whole batch
    per mini-batch: norm = sum over DP ranks of loss_normalizer(mask of this rank's mini-batch, c.loss_agg_mode, max_len)
    per micro-batch: pg, metrics = get_policy_loss(c.policy_loss)(lp, old_lp, adv_bt, mask_bt,
        loss_agg_mode=c.loss_agg_mode, global_normalizer=norm, clip_ratio_low=c.clip_ratio_low,
        clip_ratio_high=c.clip_ratio_high, clip_ratio_c=c.clip_ratio_c, rollout_log_probs_bt=rollout_lp, tis_cap=c.tis_cap)
        loss = pg - c.entropy_coef * agg_loss(entropy_bt, ...) + c.kl_loss_coef * agg_loss(kl(lp, ref_lp), ...)
        critic: value_loss(values_bt, old_values_bt, ret_bt, mask_bt, ..., value_clip=c.value_clip)

Registering a new one: @register_advantage(name), @register_policy_loss(name), @register_kl_estimator(name),
with the same signature as the existing ones.
"""
