"""engine/policy.use_fused_adam: the switch to torch's fused AdamW changes no numbers (CPU has the fused
kernel too) and survives a state-dict load that restored the foreach flags."""

import copy

import torch

from engine.roles.policy import use_fused_adam


class _Wrapper:  # megatron's optimizer wrappers expose the torch optimizer as `.optimizer`
    def __init__(self, optimizer):
        self.optimizer = optimizer


def _steps(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()


def test_fused_equals_foreach_and_survives_reload():
    torch.manual_seed(0)
    grads = [torch.randn(64) for _ in range(6)]
    p1 = torch.nn.Parameter(torch.randn(64))
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1 = torch.optim.AdamW([p1], lr=1e-2, weight_decay=0.1)
    o2 = torch.optim.AdamW([p2], lr=1e-2, weight_decay=0.1)
    use_fused_adam(_Wrapper(o2))
    assert o2.param_groups[0]["fused"] and not o2.param_groups[0]["foreach"]
    _steps(o1, p1, grads[:3])
    _steps(o2, p2, grads[:3])
    o2.load_state_dict(copy.deepcopy(o1.state_dict()))  # a checkpoint written by a foreach run
    assert not o2.param_groups[0]["fused"]
    use_fused_adam(_Wrapper(o2))
    assert o2.param_groups[0]["fused"]
    _steps(o1, p1, grads[3:])
    _steps(o2, p2, grads[3:])
    assert torch.allclose(p1, p2, atol=1e-6, rtol=0)
    assert float(o2.state[p2]["step"]) == 6.0
