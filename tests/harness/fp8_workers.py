"""FP8 training (torchao's Float8Linear) under our fully_shard against FSDP2 + torchao:
the same recipe, seed and data, both in bf16 mixed precision with the weights gathered in
bf16 (torchao's default; the FP8 gather is its own transform). Losses, full gradients and
parameters compared step by step."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import megatron_fsdp_ext as mfsdp

from .funcol_c10d import route_functional_collectives_through_c10d
from .tp_workers import placements_of, worst_against_fsdp2
from .workers import device_for_backend

D_IN, HIDDEN, D_OUT, ROWS = 64, 128, 32, 16  # FP8 matmuls want dims divisible by 16


def torchao_missing() -> str:
    """'' when torchao's float8 training imports here, else why not."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure: report it)
        return f"{type(e).__name__}: {e}"
    return ""


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D_IN, HIDDEN)
        self.mid = nn.Linear(HIDDEN, D_IN)
        self.out = nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        return self.out(F.gelu(self.mid(F.gelu(self.up(x)))))


def _float8(recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = MLP().to(device_for_backend())
    config = Float8LinearConfig() if recipe == "tensorwise" else Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config)


def float8_linear_parity(rank: int, world: int, recipes: List[str], steps: int = 3) -> Dict:
    """For each recipe: torchao Float8Linear layers sharded by ours and by FSDP2 (units:
    two layers and the root), bf16 parameters and fp32 reduction, AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8.float8_linear import Float8Linear

    device = device_for_backend()
    if dist.get_backend() == "gloo" and device.type == "cuda":  # FSDP2's full_tensor() below
        route_functional_collectives_through_c10d()
    report = {}
    for recipe in recipes:
        ours, theirs = _float8(recipe), _float8(recipe)
        assert sum(isinstance(m, Float8Linear) for m in ours.modules()) == 3
        placements = placements_of(ours)
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (ours.up, ours.mid):
            mfsdp.fully_shard(unit, mp_policy=mp)
        mfsdp.fully_shard(ours, mp_policy=mp)
        torch_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in (theirs.up, theirs.mid):
            fully_shard(unit, mp_policy=torch_mp)
        fully_shard(theirs, mp_policy=torch_mp)
        if dist.get_backend() == "gloo":  # Gloo's reduce-scatter has no average
            for m in theirs.modules():
                if hasattr(m, "set_force_sum_reduction_for_comms"):
                    m.set_force_sum_reduction_for_comms(True)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
        g = torch.Generator().manual_seed(1)
        worst = {"loss": 0.0, "grad": 0.0}
        for step in range(steps):
            x, y = torch.randn(world * ROWS, D_IN, generator=g), torch.randn(world * ROWS, D_OUT, generator=g)
            rows = slice(rank * ROWS, (rank + 1) * ROWS)
            losses = []
            for m in (ours, theirs):
                loss = F.mse_loss(m(x[rows].to(device)).float(), y[rows].to(device))
                loss.backward()
                losses.append(loss.item())
            err = abs(losses[0] - losses[1]) / abs(losses[1])
            assert err <= 1e-6, f"{recipe} step {step}: loss {losses[0]} vs FSDP2+torchao's {losses[1]}"
            worst["loss"] = max(worst["loss"], err)
            worst["grad"] = max(worst["grad"], worst_against_fsdp2(ours, theirs, "grad", placements, None, 1e-6,
                                                                   f"{recipe} step {step}, FSDP2+torchao"))
            for o in opts:
                o.step()
                o.zero_grad()
        worst_against_fsdp2(ours, theirs, "value", placements, None, 1e-6, f"{recipe} after the steps")
        # Checkpoints and state dicts hold the fp32 master values, never FP8.
        sd = mfsdp.full_state_dict(ours, rank0_only=False)
        assert all(v.dtype == torch.float32 for v in sd.values()), {k: v.dtype for k, v in sd.items()}
        report[recipe] = worst
    return report


def float8_gather_extension_refused(rank: int, world: int) -> None:
    """Weights that ask for FSDP2's all-gather extension (torchao's
    enable_fsdp_float8_all_gather=True) are refused by name, not gathered as plain values."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from .workers import expect_error

    torch.manual_seed(0)
    model = convert_to_float8_training(MLP().to(device_for_backend()),
                                       config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    expect_error(lambda: mfsdp.fully_shard(model.up), NotImplementedError, "'weight'",
                 "WeightWithDynamicFloat8CastTensor", "enable_fsdp_float8_all_gather=False")
