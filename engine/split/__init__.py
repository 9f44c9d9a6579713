"""Split placement (`placement.mode=split`): the first ranks train the actor, the last
`placement.rollout_ranks` generate with their own layout (`rollout.tp` x rollout DP).

Per step the training ranks send the actor's weights shard by shard (`parallel/split_transfer.py`) and receive
their replica's scored responses; each rollout replica e generates and scores the prompts of the training
replicas d with d mod rollout DP == e (or, with more rollout than training replicas, a share of one
replica's prompts), and sends each replica's `Responses` to that replica's tp x pp ranks (no rank gathers the
whole batch). With trainer.off_policy_steps=0 the results equal colocated placement's whenever a training
replica is cut into as many prompt shares on both sides: colocated cuts it over its micro-DP group of
parallel.tp x parallel.pp / rollout.tp ranks, split over the rollout replicas that serve it (one share at
TP = PP = 1 training and rollout.tp=1 on both sides; two for TP=2 training with two rollout replicas). Then
loader, shares and seeds are the same, so are the responses and every metric but timing. `run.py` starts a split run, `worker.py` is the rollout ranks' loop, `link.py` the
training ranks' side of the exchange, `critic.py` the loop of PPO's critic on ranks of its own
(`placement.critic_ranks`, between the training and the rollout ranks).
"""
