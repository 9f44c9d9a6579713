"""Checkpoints of a run: the run-level checkpointer (save, resume, prune), the per-role state, and the
run directory."""
