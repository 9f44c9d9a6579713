"""Command-line tools beside the training loop: export, parity, reward_check, plot (each run as
`python -m engine.<tool>` through a thin entry module in engine/)."""
