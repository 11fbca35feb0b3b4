"""A torchtitan-style training script written against FSDP2's API. Switching it to
megatron_fsdp_ext changes one import line (`--impl` picks it here so that both can be
compared in one place):

    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy     # FSDP2
    from megatron_fsdp_ext import fully_shard, MixedPrecisionPolicy          # ours

Everything else is torch: a 1-D DeviceMesh, fully_shard per block, [norm, output] as one
unit (torchtitan's own grouping), then the root, torch's MixedPrecisionPolicy fields, get_state_dict / set_state_dict and
torch.distributed.checkpoint in torchtitan's {"model", "optimizer"} layout.

    torchrun --nproc_per_node=2 examples/torchtitan_style.py --impl mfsdp --out runs/titan
"""
import argparse
import gc
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh


def import_fsdp(impl):
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from megatron_fsdp_ext import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.silu(self.up(self.mlp_norm(x))))


class Transformer(nn.Module):
    def __init__(self, vocab, dim, heads, n_layers):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def batch(step, rank, world, args, device):
    """Each rank its rows of one global batch (same data whatever the world size).
    Learnable sequences: a random start, then each token a fixed function of the last."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.empty(args.global_batch, args.seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, args.vocab, (args.global_batch,), generator=g)
    for t in range(args.seq):
        tokens[:, t + 1] = (tokens[:, t] * 5 + 3) % args.vocab
    per = args.global_batch // world
    rows = tokens[rank * per:(rank + 1) * per].to(device)
    return rows[:, :-1], rows[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=["mfsdp", "fsdp2"], default="mfsdp")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--out", default="runs/torchtitan_style")
    args = p.parse_args()
    fully_shard, MixedPrecisionPolicy = import_fsdp(args.impl)

    use_cuda = torch.cuda.is_available()
    device_type = "cuda" if use_cuda else "cpu"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must be divisible by the world size {world}")
    device = torch.device(device_type, torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp_shard",))

    torch.manual_seed(0)
    model = Transformer(args.vocab, args.dim, args.heads, args.layers).to(device)
    # bf16 compute with fp32 reduction on GPUs; fp32 on CPU (Gloo has no bf16 matmul speed to win)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if use_cuda else None, reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    # As torchtitan's apply_fsdp: the final norm and the output projection as one unit.
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)

    out = Path(args.out)
    losses = []
    for step in range(args.steps):
        inputs, labels = batch(step, rank, world, args, device)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)
        if rank == 0:
            print(f"step {step}  loss {losses[-1]:.4f}", flush=True)

    # torchtitan's checkpoint: {"model", "optimizer"} through DCP, then resumed into fresh objects
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(out / "checkpoint"))
    torch.manual_seed(1)
    fresh = Transformer(args.vocab, args.dim, args.heads, args.layers).to(device)
    for layer in fresh.layers.values():
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard([fresh.norm, fresh.output], mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(fresh, mesh=mesh, mp_policy=mp)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3, weight_decay=0.1)
    model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(out / "checkpoint"))
    set_state_dict(fresh, fresh_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    inputs, labels = batch(args.steps, rank, world, args, device)
    with torch.no_grad():
        resumed = F.cross_entropy(fresh(inputs).flatten(0, 1).float(), labels.flatten())
        original = F.cross_entropy(model(inputs).flatten(0, 1).float(), labels.flatten())
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"losses_{args.impl}.json").write_text(json.dumps(
            {"impl": args.impl, "world": world, "losses": losses,
             "resumed_eval_loss": resumed.item(), "original_eval_loss": original.item()}))
        print(f"resumed eval loss {resumed.item():.6f} (original {original.item():.6f})")
    # No rank tears Gloo down while rank 0 still writes: a peer that destroys its group early
    # can abort the process ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # The sharded modules (FSDP2's and ours) sit in reference cycles that hold their process
    # groups; collected here, the groups' threads are joined while the interpreter is whole.
    # Left to the interpreter's shutdown, a Gloo group's teardown aborted the process about
    # one run in ten on a busy 2-core machine ("terminate called without an active exception").
    gc.collect()
