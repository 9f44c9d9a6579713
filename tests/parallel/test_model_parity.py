"""Sharded model parity (world size 4): see model_parity_script.py for layouts and tolerances."""

import os

from distributed import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "model_parity_script.py")


def test_sharded_logits_and_grads_match_unsharded_model():
    out = run_torchrun(SCRIPT, nproc=4)
    layouts = ("tp2_pp2", "tp2_dp2_sp", "tp1_pp2_vpp2_dp2_tied")
    for layout in (*layouts, "moe_tp2_dp2_ep2_sp", "moe_pp2_dp2_ep2", "moe_tp2_pp2_ep2_sp"):
        assert out.count(f"PARITY {layout} ") == 4, out[-3000:]
    assert out.count("one_pass: ") == 4 * 6, out[-3000:]  # the one-pass head at every layout, every rank
