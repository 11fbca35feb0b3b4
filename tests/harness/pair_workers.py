"""Workers for tests/distributed/test_feature_pairs.py: one feature paired with another
(torch.compile with each sharding strategy, HSDP, CPU offload, buckets and a DCP
resume; HSDP with CPU offload; Hugging Face Llama with ZeRO-2 and HSDP), trained against
one plain process fed every rank's rows: losses, every step's full gradients, the
parameters after."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.core.param_index import iter_states

ROWS, DIM, VOCAB = 8, 16, 64
TOL = dict(rtol=2e-5, atol=2e-6)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM + 3)  # rows that do not split evenly
        self.down = nn.Linear(2 * DIM + 3, DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _build(hf: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if hf:
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg)
    return nn.Sequential(Block(), Block(), Block(), nn.Linear(DIM, 4))


def _blocks(model: nn.Module, hf: bool) -> list:
    return list(model.model.layers) if hf else list(model)[:3]


def _shard(model: nn.Module, case: dict, world: int) -> nn.Module:
    kwargs = {}
    if case.get("hsdp"):
        kwargs["mesh"] = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    if case.get("strategy"):
        kwargs["sharding_strategy"] = case["strategy"]
    if case.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if case.get("buckets"):
        kwargs.update(gather_bucket_bytes=1 << 16, reduce_bucket_bytes=1 << 16)
    for block in _blocks(model, case.get("hf", False)):
        mfsdp.fully_shard(block, **kwargs)
    mfsdp.fully_shard(model, **kwargs)
    for state in iter_states(model):  # the pair is what runs: every unit took the options
        assert state.options.sharding_strategy == case.get("strategy", "optim_grads_params"), state
        assert (state.process_group is not None) and (dist.get_world_size(state.process_group) ==
                                                      (2 if case.get("hsdp") else world)), state
    return model


def _batch(step: int, hf: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    if hf:
        return torch.randint(0, VOCAB, (ROWS, 6), generator=g)
    return torch.randn(ROWS, DIM, generator=g)


def _loss(run, x: torch.Tensor, hf: bool) -> torch.Tensor:
    if hf:
        return run(input_ids=x, labels=x).loss
    return run(x).pow(2).mean()


def _rows(rank: int, world: int, case: dict) -> slice:
    """This rank's rows of the batch: split over the data-parallel ranks (all of them)."""
    per = ROWS // world
    return slice(rank * per, (rank + 1) * per)


def _compiled(model: nn.Module, case: dict):
    if not case.get("compile"):
        return model
    torch._dynamo.reset()
    return torch.compile(model, backend="aot_eager")


def _check_step(model, ref, step: int, case: str) -> None:
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if name in grads:
            torch.testing.assert_close(p.grad.full_tensor(), grads[name], **TOL,
                                       msg=lambda m, name=name: f"{case}, step {step}, grad of {name}: {m}")
        else:
            assert p.grad is None, (case, step, name)


def _check_values(model, ref, case: str, when: str) -> None:
    full = mfsdp.full_state_dict(model, rank0_only=False)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, **TOL, msg=lambda m, k=k: f"{case}, {when}, {k}: {m}")


def pair_vs_one_process(rank: int, world: int, name: str, case: dict, folder: str = "") -> bool:
    from torch._dynamo.utils import counters

    hf = case.get("hf", False)
    ref = _build(hf)
    model = _shard(_build(hf), case, world)
    run = _compiled(model, case)
    counters.clear()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = _rows(rank, world, case)
    steps = 4
    for step in range(steps):
        if case.get("dcp") and step == 2:
            # Resume: save, then a fresh (other weights), sharded and compiled model and a
            # fresh optimizer load it through torch's state-dict helpers.
            path = os.path.join(folder, name)
            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=path)
            model = _shard(_build(hf, seed=5), case, world)
            run = _compiled(model, case)
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            _check_values(model, ref, name, "after the resume")
        x = _batch(step, hf)
        ref_loss = _loss(ref, x, hf)
        ref_loss.backward()
        loss = _loss(run, x[rows], hf)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total / world, ref_loss.detach(), **TOL, msg=lambda m: f"{name}, loss: {m}")
        _check_step(model, ref, step, name)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    _check_values(model, ref, name, "after training")
    if case.get("compile"):  # the blocks' computation ran compiled, not eagerly
        assert counters["stats"]["unique_graphs"] > 0, dict(counters["stats"])
    return True
