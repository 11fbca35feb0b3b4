"""Workers for tests/distributed/test_peft.py: PEFT LoRA adapters on a Hugging Face causal
LM (tiny Llama / Qwen3 from configs), sharded per decoder layer + root, trained, then
merged into the base weights and back, as RL trainers do before syncing weights to a
rollout engine (verl's `merged_lora_context`: PEFT's `merge()` on every LoRA layer, with
or without a host backup of the base weights to restore from) and as users do to export
(`merge_and_unload()`).

Each flow runs on ours and on FSDP2 under the same code, against one plain process that
does the same on every row: losses and full gradients each step, the full values after
the merge (base weights changed by the adapters' product), the merged model's logits,
and the values after the way back (unmerge or restore), then a training step after it."""
from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.distributed as dist

import megatron_fsdp_ext as mfsdp
from harness.hf_feature_workers import ROWS, batch, build
from harness.workers import device_for_backend

TOL = dict(rtol=1e-5, atol=1e-6)


def _lora(arch: str, lora_bias: bool = False):
    """The base model with LoRA on every linear layer; lora_B drawn nonzero (PEFT starts
    it at zero, so a merge would add nothing). With `lora_bias`, the base layers have
    biases and the adapters one each (lora_B.bias), which a merge adds to them."""
    from peft import LoraConfig, get_peft_model

    base = build(arch)
    if lora_bias:
        torch.manual_seed(0)
        base = type(base)(type(base.config)(**{**base.config.to_dict(), "attention_bias": True, "mlp_bias": True}))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_bias=lora_bias))
    model.to(device_for_backend())
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _shard(model, system: str, strategy: str = "optim_grads_params"):
    """Each decoder layer, then the root. `strategy`: ours by name; FSDP2's equivalents
    (ZeRO-2: no reshard after forward; no shard: HSDP over groups of one; offload:
    CPUOffloadPolicy)."""
    kwargs = {}
    if strategy == "offload":
        from torch.distributed.fsdp import CPUOffloadPolicy
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif system == "ours":
        kwargs["sharding_strategy"] = strategy
    elif strategy == "optim_grads":
        kwargs["reshard_after_forward"] = False
    elif strategy == "no_shard":
        from torch.distributed.device_mesh import init_device_mesh
        world = dist.get_world_size()
        kwargs["mesh"] = init_device_mesh(device_for_backend().type, (world, 1), mesh_dim_names=("replicate", "shard"))
    if system == "ours":
        fully_shard = mfsdp.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def _full_values(model, system: str) -> Dict[str, torch.Tensor]:
    if system == "ours":
        return mfsdp.full_state_dict(model, rank0_only=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _close(a, b, what: str):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _same_values(model, system: str, ref, what: str, changed_from=None) -> None:
    """Every value of `ref` (a plain model) in `model`'s full state dict; with
    `changed_from` ({key: value before the merge}), every adapted base weight changed."""
    full = _full_values(model, system)
    want = ref.state_dict()
    assert set(want) <= set(full), (what, set(want) - set(full))
    for k, v in want.items():
        _close(full[k].cpu(), v.cpu(), f"{what}, {k}")  # full state dicts are on the host
    if changed_from is not None:
        still = [k for k, v in changed_from.items() if torch.equal(want[k], v)]
        assert changed_from and not still, (what, still)


def _step(model, opt, ref, ref_opt, rank: int, world: int, step: int, what: str) -> None:
    """One SGD step of the LoRA parameters: ours on this rank's rows, the reference on
    all of them; the loss and every full gradient must agree."""
    per = ROWS // world
    rows = slice(rank * per, (rank + 1) * per)
    device = device_for_backend()
    ids, mask, labels = (t[:per * world].to(device) for t in batch(step))  # the rows the ranks take between them
    tokens = (labels[:, 1:] != -100).sum()
    loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows],
                 num_items_in_batch=tokens / world).loss
    loss.backward()
    want = ref(input_ids=ids, attention_mask=mask, labels=labels).loss
    want.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    at = f"{what}, step {step}"
    _close(total / world, want.detach(), f"{at}, loss")
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads) and grads, (at, set(grads) ^ set(ref_grads))
    for n, g in grads.items():
        _close(g, ref_grads[n], f"{at}, grad of {n}")
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def _logits(model, ref, what: str) -> None:
    ids, mask, _ = (t.to(device_for_backend()) for t in batch(9))
    with torch.no_grad():
        _close(model(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits,
               f"{what}, logits")


def _lora_layers(model):
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _verl_merge(model, merge: bool) -> None:
    """verl's merge or unmerge of a FSDP2 model (fsdp_merge_unmerge): torch's FSDP1
    summon_full_params around each FSDPModule but the root, which is nothing to an FSDP2
    module, and PEFT's merge() / unmerge() of every LoRA layer under it. The plain
    reference does the same to every LoRA layer."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    units = [sub for name, sub in model.named_modules() if isinstance(sub, FSDPModule) and name]
    for sub in units or [model]:
        with FullyShardedDataParallel.summon_full_params(sub, writeback=True, with_grads=False), torch.no_grad():
            for layer in _lora_layers(sub):
                if merge and not layer.merged:
                    layer.merge()
                elif not merge and layer.merged:
                    layer.unmerge()


def _backup(model) -> Dict[str, torch.Tensor]:
    """verl's backup_base_model_weights: each base weight's `.data` cloned to the host
    with the adapters disabled."""
    with torch.no_grad(), model.disable_adapter():
        return {n: p.data.clone().cpu() for n, p in model.named_parameters() if "lora" not in n.lower()}


def _restore(model, backup: Dict[str, torch.Tensor]) -> None:
    """verl's restore_base_model_weights, then its clearing of the merged adapters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in backup:
                p.data.copy_(backup[name].to(p.device))
    for layer in _lora_layers(model):
        layer.merged_adapters = []


def bf16_merge(rank: int, world: int, arch: str, system: str) -> bool:
    """A bf16 model with its adapters merged and unmerged without training: on the CPU,
    PEFT casts each adapter weight to fp32 (`weight.float()`) before the product."""
    ref = _lora(arch).to(torch.bfloat16)
    model = copy.deepcopy(ref)
    _shard(model, system)
    what = f"{arch} bf16 merge ({system})"
    adapted = {k: v.clone() for k, v in ref.state_dict().items() if k.endswith("base_layer.weight")}
    for m in (model, ref):
        m.merge_adapter()
    _same_values(model, system, ref, f"{what}, merged", changed_from=adapted)
    for m in (model, ref):
        m.unmerge_adapter()
    _same_values(model, system, ref, f"{what}, unmerged")
    return True


def lora_merge(rank: int, world: int, arch: str, flow: str, system: str,
               strategy: str = "optim_grads_params", lora_bias: bool = False) -> bool:
    ref = _lora(arch, lora_bias)
    model = copy.deepcopy(ref)
    _shard(model, system, strategy)
    what = f"{arch} {flow} ({system}, {strategy})"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    for step in range(2):
        _step(model, opt, ref, ref_opt, rank, world, step, what)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    own_before = _full_values(model, system)
    adapted = {k: v for k, v in before.items() if k.endswith("base_layer.weight") or
               (lora_bias and k.endswith("base_layer.bias"))}

    if flow == "merge_and_unload":  # the base model, its adapted layers replaced by their merged base layers
        merged, ref = model.merge_and_unload(), ref.merge_and_unload()
        _same_values(merged, system, ref, f"{what}, merged", changed_from={
            k.replace("base_model.model.", "", 1).replace(".base_layer", ""): v for k, v in adapted.items()})
        # Called through the root unit (the PEFT model around it): the base model itself
        # is a module inside that unit, which gathers at the root's forward (FSDP2's too).
        _logits(model, ref, f"{what}, merged")
        return True

    backup = _backup(model) if flow == "verl_backup" else None
    for m in (model, ref):
        if flow in ("merge_adapter", "safe_merge"):
            m.merge_adapter(safe_merge=flow == "safe_merge")
        else:
            _verl_merge(m, merge=True)
    _same_values(model, system, ref, f"{what}, merged", changed_from=adapted)
    _logits(model, ref, f"{what}, merged")  # a merged layer computes with its base weight alone
    # Back: PEFT's unmerge (subtracting the product again) or verl's restore from the
    # host backup, which gives the values from before the merge exactly.
    if flow == "verl_backup":
        _restore(model, backup)
        ref.load_state_dict(before)
        for layer in _lora_layers(ref):
            layer.merged_adapters = []
        full = _full_values(model, system)
        for k in before:
            assert torch.equal(full[k].cpu(), own_before[k].cpu()), f"{what}, {k} after the restore"
    else:
        for m in (model, ref):
            if flow in ("merge_adapter", "safe_merge"):
                m.unmerge_adapter()
            else:
                _verl_merge(m, merge=False)
        _same_values(model, system, ref, f"{what}, unmerged")
        for k, v in before.items():
            _close(ref.state_dict()[k], v, f"{what}, reference {k} after unmerge")
    _step(model, opt, ref, ref_opt, rank, world, 2, f"{what}, after the merge")
    return True


def adapter_added_after_sharding(rank: int, world: int) -> bool:
    """PEFT's add_adapter on the sharded model puts plain parameters into the units'
    modules: their gradients would stay each rank's own (FSDP2 trains them so, silently).
    The first optimizer step holding them is refused, naming one."""
    from peft import LoraConfig
    from harness.workers import expect_error

    model = _lora("llama")
    _shard(model, "ours")
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"]))
    model.set_adapter("second")
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids, mask, labels = (t.to(device_for_backend()) for t in batch(0))
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    expect_error(opt.step, NotImplementedError, ".second.weight", "added to the unit's modules after fully_shard")
    return True


def adapter_workflow(rank: int, world: int, out_dir: str) -> bool:
    """What LoRA training scripts do around the step, on ours against one plain process:
    forwards with the adapters disabled (evaluation; DPO's reference model, under no_grad,
    between training steps), PEFT's adapter state dict (full values), save_pretrained of
    the adapters (called on every rank; the file loads into a plain PeftModel), and
    set_peft_model_state_dict of other adapter weights, each followed by a training step."""
    from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    ref = _lora("llama")
    model = copy.deepcopy(ref)
    _shard(model, "ours")
    what = "llama adapters (ours)"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    _step(model, opt, ref, ref_opt, rank, world, 0, what)

    with model.disable_adapter(), ref.disable_adapter():
        _logits(model, ref, f"{what}, adapters disabled")
    _logits(model, ref, f"{what}, adapters enabled again")
    per = ROWS // world
    ids, mask, _ = (t.to(device_for_backend()) for t in batch(3))
    with torch.no_grad(), model.disable_adapter(), ref.disable_adapter():  # DPO's reference forward
        _close(model(input_ids=ids[rank * per:(rank + 1) * per], attention_mask=mask[rank * per:(rank + 1) * per]).logits,
               ref(input_ids=ids, attention_mask=mask).logits[rank * per:(rank + 1) * per], f"{what}, reference forward")
    _step(model, opt, ref, ref_opt, rank, world, 1, f"{what}, after the reference forward")

    want = get_peft_model_state_dict(ref)
    got = get_peft_model_state_dict(model)
    assert set(got) == set(want) and want, (what, set(got) ^ set(want))
    for k, v in want.items():
        _close(got[k].full_tensor().cpu(), v.cpu(), f"{what}, get_peft_model_state_dict {k}")

    model.save_pretrained(f"{out_dir}/sharded")  # every rank: it gathers; rank 0 writes
    if rank == 0:
        ref.save_pretrained(f"{out_dir}/plain")
    dist.barrier()
    saved, plain = (load_file(f"{out_dir}/{d}/adapter_model.safetensors") for d in ("sharded", "plain"))
    assert set(saved) == set(plain), (what, set(saved) ^ set(plain))
    for k, v in plain.items():
        _close(saved[k], v, f"{what}, saved {k}")
    loaded = PeftModel.from_pretrained(build("llama").to(device_for_backend()), f"{out_dir}/sharded")
    _logits(loaded, ref, f"{what}, the saved adapters in a plain model")

    other = {k: torch.randn_like(v.cpu(), generator=torch.Generator().manual_seed(9)).to(v.device) * 0.05
             for k, v in want.items()}
    set_peft_model_state_dict(ref, {k: v.clone() for k, v in other.items()})
    set_peft_model_state_dict(model, {k: v.clone() for k, v in other.items()})
    _logits(model, ref, f"{what}, after set_peft_model_state_dict")
    _step(model, opt, ref, ref_opt, rank, world, 2, f"{what}, after set_peft_model_state_dict")
    return True
