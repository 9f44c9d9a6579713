"""The native engine's decode-slot bookkeeping (engine/rollout/decode_state.py) on its own, on the CPU; the
engine around it: tests/engine/test_rollout_native.py, tests/engine/test_paged_kv.py."""

from __future__ import annotations

import torch

from engine.rollout.decode_state import SlotState


def test_each_slot_reads_its_prompt_from_the_first_live_slot_of_its_group():
    """`SlotState.refresh_prefix_from`: a finished slot is skipped as source (its positions may be overwritten
    or freed); a group with no live slot and a filler (-1) point at themselves; slots past the width keep
    theirs."""
    st = SlotState.reuse(None, 7, 0, 0, torch.device("cpu"))
    st.group[:] = torch.tensor([5, 5, 5, 7, 7, 9, -1])
    st.alive[:] = torch.tensor([False, True, True, True, False, False, False])
    st.prefix_from[6] = 0
    st.refresh_prefix_from(6)
    assert st.prefix_from.tolist() == [1, 1, 1, 3, 3, 5, 0]
    assert SlotState.reuse(st, 7, 0, 0, torch.device("cpu")) is st
    assert SlotState.reuse(st, 8, 0, 0, torch.device("cpu")) is not st
    st.set_idle(1, 3, 7, 0)  # fillers point at themselves
    assert st.prefix_from[:3].tolist() == [1, 1, 2] and st.group[1:3].eq(-1).all()
