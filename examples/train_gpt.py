"""Train a small GPT with megatron_fsdp_ext (the README's main job).

    torchrun --nproc_per_node=2 examples/train_gpt.py          # CPU + Gloo, or GPUs + NCCL
    torchrun --nproc_per_node=4 examples/train_gpt.py --tp 2   # 2-D: FSDP 2 x tensor parallel 2

The corpus is embedded: the source text of the Python standard library that runs
this script, read at start-up and tokenized as bytes (vocabulary 256). Without a
GPU it trains on CPU with Gloo; with GPUs, on one GPU per process with NCCL and
bf16 mixed precision. At the end rank 0 writes a loss-curve PNG and a full (unsharded)
state-dict checkpoint that loads into the plain LlamaModel.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel, tensor_parallel


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--fp8", choices=["none", "tensorwise", "tensorwise_gather"], default="none",
                   help="train the blocks' linear layers in FP8 with torchao's Float8Linear (tensorwise "
                        "scaling); tensorwise_gather also all-gathers their weights in FP8 (needs torchao)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel degree: the model is split over groups of this many ranks "
                        "(models.tensor_parallel) and sharded over the rest (a (world/tp, tp) mesh)")
    p.add_argument("--offload", action="store_true",
                   help="CPU offload: weights, gradients and AdamW state in (pinned) host memory, stepped by "
                        "megatron_fsdp_ext.optim.CPUAdamW with its overlapped step")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="MiB of stdlib source to read")
    p.add_argument("--out-dir", default="runs/train_gpt")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--metrics-json", default=None,
                   help="rank 0 writes per-step losses, the held-out loss and the checkpoint path here")
    return p.parse_args()


def setup_distributed(device_choice: str):
    use_cuda = torch.cuda.is_available() and device_choice != "cpu"
    if device_choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda given but no CUDA device is visible")
    if "RANK" not in os.environ:  # plain `python examples/train_gpt.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    return device


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Bytes of the standard library's .py files, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise SystemExit(f"could not read enough standard-library source under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


def batches(corpus, steps, global_batch, seq_len, rank, world, device):
    """Each step samples `global_batch` windows (same on all ranks); a rank takes its rows."""
    g = torch.Generator().manual_seed(0)
    holdout = corpus.numel() // 20  # the last 5% is for validation
    per_rank = global_batch // world
    for _ in range(steps):
        starts = torch.randint(0, corpus.numel() - holdout - seq_len - 1, (global_batch,), generator=g)
        mine = starts[rank * per_rank:(rank + 1) * per_rank]
        idx = mine[:, None] + torch.arange(seq_len + 1)[None, :]
        window = corpus[idx]
        yield window[:, :-1].to(device, non_blocking=True), window[:, 1:].to(device, non_blocking=True)


def held_out_batch(corpus, seq_len, max_rows=16):
    """Up to `max_rows` consecutive windows from the last 5% of the corpus, which
    training never samples: (tokens, targets) on the CPU."""
    held = corpus[-(corpus.numel() // 20):]
    n = (held.numel() - 1) // seq_len
    rows = torch.arange(min(n, max_rows)) * seq_len
    window = held[rows[:, None] + torch.arange(seq_len + 1)[None, :]]
    return window[:, :-1], window[:, 1:]


def main():
    args = parse_args()
    device = setup_distributed(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    cfg = LlamaConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      ffn_hidden=int(8 * args.d_model / 3) // 8 * 8, max_seq_len=args.seq_len,
                      tie_embeddings=True)
    model = LlamaModel(cfg).to(device)
    if args.tp < 1 or world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size {world}")
    # A 2-D mesh: tensor parallel inside groups of --tp ranks, FSDP across them.
    mesh = init_device_mesh(device.type, (world // args.tp, args.tp), mesh_dim_names=("dp_shard", "tp"))
    if args.tp > 1:
        tensor_parallel(model, mesh["tp"])
    if args.fp8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=args.fp8 == "tensorwise_gather")
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    dp_rank, dp_world = mesh.get_local_rank("dp_shard"), world // args.tp
    mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else mfsdp.MixedPrecisionPolicy()
    offload = {}
    if args.offload:
        from torch.distributed.fsdp import CPUOffloadPolicy
        offload = {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    for block in model.blocks:
        mfsdp.fully_shard(block, mp_policy=mp, mesh=mesh["dp_shard"], **offload)
    mfsdp.fully_shard(model, mp_policy=mp, mesh=mesh["dp_shard"], **offload)
    if args.offload:
        from megatron_fsdp_ext.optim import CPUAdamW
        opt = CPUAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, overlap_step=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                fused=device.type == "cuda" or None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    corpus = load_corpus(int(args.corpus_mb * (1 << 20)))
    n_params = sum(p.numel() for p in LlamaModel(cfg).parameters())
    if rank == 0:
        print(f"megatron_fsdp_ext {mfsdp.__version__} | world {world} (fsdp {dp_world} x tp {args.tp}) on {device.type} "
              f"({dist.get_backend()}) | {n_params / 1e6:.2f}M params | corpus {corpus.numel() / 1e6:.1f}M bytes",
              flush=True)

    try:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, disable=rank != 0, dynamic_ncols=True, mininterval=1.0, file=sys.stdout)
    except ImportError:  # the progress bar is optional; the log line below is not
        bar = None
    global_batch = args.micro_batch * dp_world  # the tp ranks of a group share their rows
    losses, t_last = [], time.perf_counter()
    for step, (tokens, targets) in enumerate(
            batches(corpus, args.steps, global_batch, args.seq_len, dp_rank, dp_world, device)):
        loss = model.loss(tokens, targets)
        loss.backward()
        gnorm = mfsdp.clip_grad_norm_(model, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        avg = avg.item() / world
        losses.append(avg)
        now = time.perf_counter()
        tok_s = global_batch * args.seq_len / (now - t_last)
        t_last = now
        if bar is not None:
            bar.set_postfix(loss=f"{avg:.3f}", gnorm=f"{gnorm.item():.2f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)
        elif rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d} loss {avg:.4f} tokens/s {tok_s:,.0f}", flush=True)
    if bar is not None:
        bar.close()

    # Held-out loss, then the artefacts.
    model.eval()
    held_tokens, held_targets = held_out_batch(corpus, args.seq_len)
    with torch.no_grad():
        val = model.loss(held_tokens.to(device), held_targets.to(device)).item()
    state = mfsdp.full_state_dict(model)  # collective: every rank calls it
    if rank == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        ckpt = out / "model_full.pt"
        torch.save({"config": cfg.__dict__, "model": state, "losses": losses}, ckpt)
        # The checkpoint loads into the plain module and reproduces the held-out loss.
        plain = LlamaModel(cfg)
        plain.load_state_dict(torch.load(ckpt, weights_only=True)["model"], strict=True)
        with torch.no_grad():
            plain_val = plain.loss(held_tokens, held_targets).item()
        png = write_loss_curve(losses, out / "loss_curve.png", world, device.type)
        print(f"final train loss {losses[-1]:.4f} (first {losses[0]:.4f}) | held-out loss {val:.4f} "
              f"(plain module from checkpoint: {plain_val:.4f})")
        print(f"wrote {ckpt} and {png}")
        if args.metrics_json:
            Path(args.metrics_json).write_text(json.dumps({
                "world": world, "tp": args.tp, "fp8": args.fp8, "device": device.type, "steps": args.steps,
                "seq_len": args.seq_len,
                "corpus_bytes": corpus.numel(), "losses": losses, "held_out_loss": val,
                "held_out_loss_plain_module": plain_val, "checkpoint": str(ckpt)}, indent=1))
        if not losses[-1] < losses[0]:
            raise SystemExit("training did not reduce the loss")
    dist.barrier()
    dist.destroy_process_group()


def write_loss_curve(losses, path, world, device_type):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path.with_suffix(".csv")
        path.write_text("step,loss\n" + "".join(f"{i},{v}\n" for i, v in enumerate(losses)))
        return path
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    ax.plot(range(len(losses)), losses, lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(f"train_gpt: {world} rank(s) on {device_type}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
