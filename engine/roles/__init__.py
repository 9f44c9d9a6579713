"""The model roles of a run: the Megatron model role (actor, critic, reference), micro-batching, offload
and the reward model."""
