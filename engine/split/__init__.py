"""Split placement (`placement.mode=split`): the first ranks train the actor, the last
`placement.rollout_ranks` generate with their own layout (`rollout.tp` x rollout DP).

Per step the training ranks send the actor's weights shard by shard (`parallel/split_transfer.py`) and receive
their replica's scored responses; each rollout replica e generates and scores the prompts of the training
replicas d with d mod rollout DP == e, exactly as colocated placement at rollout.tp=1 would (same prompt
loader, same seeds), and sends each replica's `Responses` to that replica's tp x pp ranks (no rank gathers
the whole batch). `run.py` starts a split run, `worker.py` is the rollout ranks' loop, `link.py` the
training ranks' side of the exchange.
"""
