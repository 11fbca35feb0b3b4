"""The optimizer link (megatron_fsdp_ext/shard_changes.py): nothing is registered at
import; after fully_shard only optimizers holding sharded parameters get hooks, also when
the parameters arrive through add_param_group after a first step; and the steps of such
an optimizer reach the kept unsharded copies (strategy `optim`), against plain PyTorch."""
import subprocess
import sys

import torch
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from harness import run_distributed


def test_import_registers_no_global_optimizer_hook():
    code = ("import torch.optim.optimizer as o; before = (len(o._global_optimizer_pre_hooks), "
            "len(o._global_optimizer_post_hooks)); import megatron_fsdp_ext; "
            "after = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks)); "
            "assert before == after == (0, 0), (before, after); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _only_our_optimizers(rank, world):
    ref, model = _net(), _net()
    for layer in (model[0], model[2]):
        mfsdp.fully_shard(layer, sharding_strategy="optim")  # keeps gathered copies between steps
    mfsdp.fully_shard(model, sharding_strategy="optim")

    foreign_param = nn.Parameter(torch.ones(3))
    foreign = torch.optim.SGD([foreign_param], lr=0.1)
    foreign_param.grad = torch.ones(3)
    foreign.step()
    assert foreign.__dict__["_mfsdp_adopted"] == (False, 1)
    assert not foreign._optimizer_step_post_hooks, "an optimizer without sharded parameters got a hook"

    # The same optimizer later given the model's parameters: adopted at its next step.
    foreign.add_param_group({"params": list(model.parameters())})
    ref_opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))] + list(ref.parameters()), lr=0.1)
    per = 4 // world
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        ref(x).pow(2).mean().backward()
        model(x[rank * per:(rank + 1) * per]).pow(2).mean().backward()
        ref_opt.step()
        foreign.step()
        ref_opt.zero_grad()
        foreign.zero_grad()
        # Without the step marking the kept copies stale, this forward used old weights.
        with torch.no_grad():
            torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-6)
    assert foreign.__dict__["_mfsdp_adopted"] == (True, 2)
    assert len(foreign._optimizer_step_post_hooks) == 1
    return True


def test_only_optimizers_holding_sharded_parameters_are_adopted():
    assert run_distributed(_only_our_optimizers, 2, timeout=180) == [True, True]
