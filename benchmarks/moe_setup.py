"""Mixture-of-experts set-up shared by the benchmarks (bench_train.py, simulate.py): the
MoE version of a shape, the expert-parallel meshes, and both FSDPs putting the experts on
the expert data-parallel mesh the way FSDP2 does it on the installed torch."""
from __future__ import annotations

FORMS = ("auto", "shard_placement_fn", "experts_unit")


def moe_config(shape, experts: int, top_k: int):
    """megatron_fsdp_ext.models.MoEConfig of a benchmarks/shapes.py shape whose MLPs become
    `experts` routed SwiGLU experts, each ffn / top_k wide (the routed width per token
    stays the dense ffn)."""
    from megatron_fsdp_ext.models import MoEConfig

    vocab, d, layers, heads, ffn, _, seq = shape
    return MoEConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn, max_seq_len=seq,
                     n_experts=experts, top_k=top_k, expert_hidden=max(1, ffn // top_k))


def balanced_routing(model) -> None:
    """Route every MoE layer of `model` by a fixed, balanced pattern: token i goes to experts
    (i * top_k + j) % n_experts, j < top_k, in that order of preference. The router still
    runs and gets its gradient (the pattern replaces its logits' values, not their graph).

    Under the fake backend a gather moves nothing: the local shard lands in every chunk, so
    a gathered weight is this rank's shard repeated, laid out by each system's own shard
    shape. FSDP2's router weight (one row a rank at W 64) becomes one row repeated: every
    logit ties and every token goes to the same two experts. Ours (flat shards) repeats a
    slice of the unit's buffer whose rows differ, and the tokens spread. The tensors sized
    by the kept (token, choice) pairs then differ between the systems. With this pattern
    every system keeps every pair (the capacity is 1.25x the fair share), whatever the
    weights hold."""
    import torch

    cache = {}

    def pattern(logits):
        n, e = logits.shape
        key = (n, e, logits.device, logits.dtype)
        if key not in cache:
            top_k = model.cfg.top_k
            experts = (torch.arange(n, device=logits.device)[:, None] * top_k
                       + torch.arange(top_k, device=logits.device)) % e
            preference = torch.arange(top_k, 0, -1, device=logits.device, dtype=logits.dtype).expand(n, top_k)
            cache[key] = torch.zeros(n, e, device=logits.device, dtype=logits.dtype).scatter(1, experts, preference)
        return cache[key]

    def fixed_logits(module, args, out):
        return pattern(out) + (out - out.detach())  # the pattern's values exactly, the router's gradient

    for block in model.blocks:
        block.moe.router.register_forward_hook(fixed_logits)


def routing_kept_fraction(model, forward, device_type: str, autocast: bool) -> float:
    """The share of (token, choice) pairs the MoE layers of `model` kept (within their
    experts' capacity) in one call of `forward`, run without grad and under bf16 autocast
    where the training step uses it: 1.0 under balanced_routing, less wherever the
    router's own choices overflow an expert."""
    import torch
    import torch.nn.functional as F

    kept_and_total = [0, 0]

    def observe(module, args, out):
        chosen = torch.softmax(out.float(), dim=-1).topk(model.cfg.top_k, dim=-1).indices.reshape(-1)
        place = (torch.cumsum(F.one_hot(chosen, out.shape[-1]), dim=0) - 1).gather(1, chosen[:, None]).squeeze(1)
        kept_and_total[0] += int((place < model.cfg.capacity(out.shape[0])).sum())
        kept_and_total[1] += chosen.numel()

    handles = [block.moe.router.register_forward_hook(observe) for block in model.blocks]
    try:
        with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return kept_and_total[0] / kept_and_total[1]


def check_ep(ep: int, experts: int, world: int) -> None:
    if ep > 1 and (not experts or experts % ep or world % ep):
        raise SystemExit(f"--ep {ep}: needs --experts divisible by it and a world it divides "
                         f"(experts {experts}, world {world})")


def expert_parallel_meshes(model, device_type: str, world: int, ep: int):
    """The experts of `model` expert-parallel over the "ep" dim of a (W/E, E) mesh; returns
    (the dense mesh over all W ranks, the expert data-parallel mesh "efsdp")."""
    from torch.distributed.device_mesh import init_device_mesh

    from megatron_fsdp_ext.models import expert_parallel

    sparse = init_device_mesh(device_type, (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    expert_parallel(model, sparse["ep"])
    return init_device_mesh(device_type, (world,), mesh_dim_names=("fsdp",)), sparse["efsdp"]


def _expert_dim(weight, efsdp_size: int):
    """torchtitan's rule: where the expert data-parallel mesh has more ranks than there are
    local experts, dim 0 would be padded up to the mesh size, so dim 1 is sharded instead.
    FSDP2 refuses uneven shards on any dim but 0, so where dim 1 does not divide evenly the
    next dim that does is taken (torchtitan would fail there), and dim 0 where none does."""
    from torch.distributed.tensor import Shard

    shape = (weight.to_local() if hasattr(weight, "to_local") else weight).shape
    if efsdp_size <= shape[0]:
        return Shard(0)
    return next((Shard(d) for d in range(1, len(shape)) if shape[d] % efsdp_size == 0), Shard(0))


def expert_placement_fn(model, mesh_size: int):
    """Without expert parallelism, torchtitan's placement for a block's experts sharded with
    the dense parameters over `mesh_size` ranks (its ep_degree == 1 path): off dim 0 where
    the mesh has more ranks than there are experts (_expert_dim), dim 0 for everything else.
    None for a model without experts."""
    from torch.distributed.tensor import Shard

    if not hasattr(model.blocks[0], "moe"):
        return None
    dims = {p: _expert_dim(p, mesh_size) for b in model.blocks for p in b.moe.experts.parameters()}
    return lambda p: dims.get(p, Shard(0))


def shard_moe_blocks(model, shard, dense, efsdp, form: str = "auto", **kwargs) -> str:
    """Every MoE block sharded by `shard` (either library's fully_shard): dense parameters
    over `dense`, experts over `efsdp`; then the root. form "shard_placement_fn": one call
    per block whose shard_placement_fn returns FSDP2's ShardPlacementResult (torchtitan
    0.3.0, torch 2.12+); "experts_unit": the experts a unit of their own on efsdp inside
    the block's (torchtitan 0.2); "auto": the first where torch has it. Experts shard dim 1
    where efsdp has more ranks than the block has local experts (_expert_dim), else dim 0.
    Returns the form."""
    from torch.distributed.fsdp._fully_shard import _fsdp_common as common
    from torch.distributed.tensor import Shard

    if form not in FORMS:
        raise SystemExit(f"--moe-form {form!r}: choose from {FORMS}")
    if form == "auto":
        form = "shard_placement_fn" if hasattr(common, "ShardPlacementResult") else "experts_unit"
    if form == "shard_placement_fn" and not hasattr(common, "ShardPlacementResult"):
        raise SystemExit("--moe-form shard_placement_fn: this torch has no ShardPlacementResult (2.12+)")
    for block in model.blocks:
        experts = set(block.moe.experts.parameters())
        dims = {p: _expert_dim(p, efsdp.size()) for p in experts}
        if form == "shard_placement_fn":
            infos = (common.FSDPMeshInfo(efsdp, shard_mesh_dim=0), common.FSDPMeshInfo(dense, shard_mesh_dim=0))
            shard(block, mesh=dense, shard_placement_fn=lambda p, dims=dims, infos=infos:
                  common.ShardPlacementResult(dims[p], infos[0]) if p in dims
                  else common.ShardPlacementResult(Shard(0), infos[1]), **kwargs)
        else:
            shard(block.moe.experts, mesh=efsdp, shard_placement_fn=lambda p, dims=dims: dims[p], **kwargs)
            shard(block, mesh=dense, **kwargs)
    shard(model, mesh=dense, **kwargs)
    return form
