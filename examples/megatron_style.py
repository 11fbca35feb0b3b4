"""A Megatron-style training script on megatron_fsdp_ext: Megatron's flag names, an
FSDPConfig, fully_shard_model, and sharded (DCP) checkpoints that resume under another
sharding strategy or world size.

    torchrun --nproc_per_node=2 examples/megatron_style.py --train-iters 30 --save runs/ckpt
    torchrun --nproc_per_node=2 examples/megatron_style.py --train-iters 60 --load runs/ckpt \\
        --data-parallel-sharding-strategy no_shard

Checkpoints are laid out as Megatron's: `<save>/iter_0000030/` plus
`<save>/latest_checkpointed_iteration.txt`; `--load` resumes the latest one, or the
iteration `--ckpt-step` names.

Switching a Megatron script over is the block marked "the switch" below. Trains on the
same embedded corpus as train_gpt.py (CPU + Gloo without a GPU, NCCL + bf16 with GPUs).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # train_gpt's data helpers
from train_gpt import batches, load_corpus, setup_distributed  # noqa: E402

import megatron_fsdp_ext as mfsdp  # noqa: E402
from megatron_fsdp_ext.models import Block, LlamaConfig, LlamaModel  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                   choices=sorted(mfsdp.tools.config.SHARDING_STRATEGIES))
    p.add_argument("--bf16", action="store_true", help="bf16 params and compute (default on with GPUs)")
    p.add_argument("--grad-reduce-in-fp32", action="store_true")
    p.add_argument("--no-overlap-grad-reduce", action="store_true")
    p.add_argument("--no-overlap-param-gather", action="store_true")
    p.add_argument("--train-iters", type=int, default=30, help="total iterations, resumed ones included")
    p.add_argument("--global-batch-size", type=int, default=16, help="sequences per iteration, all ranks")
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save", default=None, help="directory for sharded checkpoints (at the end, and every --save-interval)")
    p.add_argument("--save-interval", type=int, default=None, help="also save after every this many iterations")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from (its latest iteration)")
    p.add_argument("--ckpt-step", type=int, default=None, help="resume from this saved iteration instead of the latest")
    p.add_argument("--metrics-json", default=None,
                   help="rank 0 writes the starting iteration, each iteration's loss and the saved iterations here")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p.parse_args()


TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def save(root: str, iteration: int, model, optimizer, rank: int) -> None:
    """Sharded checkpoint of `iteration` (iterations done), then the tracker (rank 0)."""
    mfsdp.save_checkpoint(str(iteration_dir(root, iteration)), model, optimizer)
    dist.barrier()  # every rank has written its part before the tracker names it
    if rank == 0:
        (Path(root) / TRACKER).write_text(f"{iteration}\n")
        print(f"saved a sharded checkpoint of iteration {iteration} to {iteration_dir(root, iteration)}", flush=True)


def resume_iteration(root: str, ckpt_step) -> int:
    if ckpt_step is not None:
        iteration = ckpt_step
    else:
        tracker = Path(root) / TRACKER
        if not tracker.is_file():
            raise SystemExit(f"--load {root}: no {TRACKER} (not a checkpoint directory written with --save)")
        iteration = int(tracker.read_text().strip())
    if not iteration_dir(root, iteration).is_dir():
        raise SystemExit(f"--load {root}: no checkpoint of iteration {iteration} ({iteration_dir(root, iteration)})")
    return iteration


def main():
    args = parse_args()
    if args.save_interval is not None and args.save_interval < 1:
        raise SystemExit(f"--save-interval must be >= 1, got {args.save_interval}")
    if args.save_interval is not None and not args.save:
        raise SystemExit("--save-interval needs --save")
    device = setup_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, d_model=args.hidden_size, n_layers=args.num_layers,
                      n_heads=args.num_attention_heads, ffn_hidden=int(8 * args.hidden_size / 3) // 8 * 8,
                      max_seq_len=args.seq_length)
    model = LlamaModel(cfg).to(device)

    # ---- the switch: a Megatron DDP/FSDP config becomes an FSDPConfig ----
    bf16 = args.bf16 or device.type == "cuda"
    config = mfsdp.FSDPConfig(
        data_parallel_sharding_strategy=args.data_parallel_sharding_strategy,
        overlap_grad_reduce=not args.no_overlap_grad_reduce,
        overlap_param_gather=not args.no_overlap_param_gather,
        grad_reduce_in_fp32=args.grad_reduce_in_fp32 or bf16,
        bf16=bf16,
    )
    model = mfsdp.fully_shard_model(model, config, fsdp_unit_modules=[Block])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    mfsdp.attach_param_sync(optimizer, model)  # gathers launched right after each step
    # ----------------------------------------------------------------------

    start = 0
    if args.load:
        start = resume_iteration(args.load, args.ckpt_step)
        mfsdp.load_checkpoint(str(iteration_dir(args.load, start)), model, optimizer)
    corpus = load_corpus(4 << 20)
    if rank == 0:
        print(f"{config.data_parallel_sharding_strategy} on {world} rank(s), {device.type}; "
              f"starting at iteration {start}", flush=True)
    if args.global_batch_size % world:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} is not divisible by the world size {world}")
    # Same global batches at any world size: a resumed run continues the same stream.
    data = batches(corpus, args.train_iters, args.global_batch_size, args.seq_length, rank, world, device)
    loss_first = loss_last = None
    losses, saved = [], []
    for it, (tokens, targets) in enumerate(data):
        if it < start:  # the data stream is deterministic: skip what the loaded run consumed
            continue
        loss = model.loss(tokens, targets)
        loss.backward()
        mfsdp.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        loss_last = avg.item() / world
        loss_first = loss_first if loss_first is not None else loss_last
        losses.append((it, loss_last))
        if rank == 0 and (it % 10 == 0 or it == args.train_iters - 1):
            print(f"iteration {it:4d} | loss {loss_last:.4f}", flush=True)
        done = it + 1
        if args.save_interval and done % args.save_interval == 0 and done < args.train_iters:
            save(args.save, done, model, optimizer, rank)
            saved.append(done)
    if args.save:
        save(args.save, args.train_iters, model, optimizer, rank)
        saved.append(args.train_iters)
    if rank == 0 and loss_first is not None:
        print(f"loss {loss_first:.4f} -> {loss_last:.4f}")
    if rank == 0 and args.metrics_json:
        Path(args.metrics_json).write_text(json.dumps({
            "world": world, "strategy": config.data_parallel_sharding_strategy, "start_iteration": start,
            "losses": losses, "saved_iterations": saved}, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
