"""Checkpoint save and load time: ours (save_checkpoint, sync and async_save=True;
load_checkpoint) against FSDP2 (torch fully_shard) with torch.distributed.checkpoint
(dcp.save, dcp.async_save, dcp.load), on the same Llama-style model and world.

    torchrun --nproc_per_node=4 benchmarks/bench_async_save.py --system mfsdp --model 1b --out $OUT/mfsdp.json
    torchrun --nproc_per_node=4 benchmarks/bench_async_save.py --system fsdp2 --model 1b --out $OUT/fsdp2.json

One system per process run (run each in its own torchrun). The model is bench_train's
(--model: one of its CONFIGS, "1b" has 1.35B parameters; or ckpt_33m, the model of
RESULTS.md table 9), trained one AdamW step so the
optimizer state exists, then, --repeats times each:

- sync:  the synchronous save; the time training is blocked (call to return);
- async: the asynchronous save; blocked (call to return: the state dicts and the copy to
         host memory, pinned on CUDA) and total (call to the save being published);
         FSDP2: dcp.async_save with torch's DefaultStager (pinned, synchronous staging,
         so that training may change the parameters when it returns, as with ours);
- load:  loading the last synchronous checkpoint back into the model (ours:
         load_checkpoint, which checks the manifest's hashes; FSDP2: dcp.load into
         get_model/optimizer_state_dict, then set_model/optimizer_state_dict).

Every time is the slowest rank's (each rank's clock runs from a barrier to the end of its
own work, stopped after torch.cuda.synchronize()); min/median/max over the repeats. Each
checkpoint is removed after it is measured. `--device cpu --model tiny` runs the same code
on Gloo (a smoke run, not a measurement).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import CONFIGS, build  # noqa: E402
from run_meta import init_benchmark_process, run_meta  # noqa: E402

import megatron_fsdp_ext as mfsdp  # noqa: E402
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel  # noqa: E402

MODES = ("sync", "async", "load")
# bench_train's models, and the one of benchmarks/RESULTS.md table 9 (bench_checkpoint.py's
# default: 33M parameters, 504 MB with AdamW state), small enough for a CPU measurement.
MODELS = dict(CONFIGS, ckpt_33m=(8192, 512, 8, 8, 2048, 2, 64))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", choices=("mfsdp", "fsdp2"), required=True)
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {MODES}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--dir", default=None, help="where the temporary directory of the checkpoints is made "
                                                "(default: the system's temporary directory)")
    p.add_argument("--out", default=None, help="the JSON file to write")
    args = p.parse_args()
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES))
    if unknown:
        p.error(f"unknown modes {unknown}; choose from {MODES}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _summary(xs):
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def _train_one_step(model, opt, vocab: int, device: torch.device, autocast: bool) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    data = torch.randint(0, vocab, (1, 129), generator=g).to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(data[:, :-1])
    torch.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), data[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class Ours:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def save(self, path):
        mfsdp.save_checkpoint(path, self.model, self.opt)

    def async_save(self, path):
        return mfsdp.save_checkpoint(path, self.model, self.opt, async_save=True)

    @staticmethod
    def wait(handle):
        handle.result()

    def load(self, path):
        mfsdp.load_checkpoint(path, self.model, self.opt)

    def close(self):
        mfsdp.dcp.release_async_save_buffers()

    staging = "megatron_fsdp_ext host copy (pinned on CUDA), synchronous"


class Fsdp2:
    def __init__(self, model, opt, device: torch.device):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as sd

        self.dcp, self.sd, self.model, self.opt = dcp, sd, model, opt
        # dcp.async_save needs a group with a CPU backend: Gloo beside NCCL.
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        self.stager, self.staging = None, "dcp.async_save's default"
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:  # a torch before the configurable stager
            return
        if "async_stager" not in inspect.signature(dcp.async_save).parameters:
            return
        cuda = device.type == "cuda"
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))
        self.staging = f"DefaultStager(pinned={cuda}, synchronous)"

    def _state(self):
        return {"model": self.sd.get_model_state_dict(self.model),
                "optimizer": self.sd.get_optimizer_state_dict(self.model, self.opt)}

    def save(self, path):
        self.dcp.save(self._state(), checkpoint_id=path)

    def async_save(self, path):
        kwargs = {"async_stager": self.stager} if self.stager is not None else {}
        return self.dcp.async_save(self._state(), checkpoint_id=path, process_group=self.group, **kwargs)

    @staticmethod
    def wait(handle):
        upload = getattr(handle, "upload_completion", handle)  # AsyncSaveResponse or a Future
        upload.result()

    def load(self, path):
        state = self._state()
        self.dcp.load(state, checkpoint_id=path)
        self.sd.set_model_state_dict(self.model, state["model"])
        self.sd.set_optimizer_state_dict(self.model, self.opt, state["optimizer"])

    def close(self):
        if self.stager is not None:
            self.stager.close()


def main() -> None:
    args = parse_args()
    device = init_benchmark_process(args.device, 29581)
    rank, world = dist.get_rank(), dist.get_world_size()
    vocab, d, layers, heads, ffn, _, seq = MODELS[args.model]
    cfg = LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn, max_seq_len=seq)
    _, model, autocast = build(args.system, cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    _train_one_step(model, opt, vocab, device, autocast)
    system = Ours(model, opt) if args.system == "mfsdp" else Fsdp2(model, opt, device)
    root = tempfile.mkdtemp(prefix="mfsdp_async_bench_", dir=args.dir) if rank == 0 else None
    box = [root]
    dist.broadcast_object_list(box)
    root = box[0]

    def remove(path):
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def clock(fn):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        out = fn()
        _sync(device)
        return out, time.perf_counter() - start

    results, nbytes = {}, 0
    if "sync" in args.modes or "load" in args.modes:
        blocked = []
        for i in range(args.repeats):
            path = os.path.join(root, f"sync_{i}")
            _, seconds = clock(lambda: system.save(path))
            blocked.append(_slowest(seconds, device))
            last = i == args.repeats - 1
            if last:
                nbytes = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
            if last and "load" in args.modes:
                loads = []
                for _ in range(args.repeats):
                    _, seconds = clock(lambda: system.load(path))
                    loads.append(_slowest(seconds, device))
                results["load"] = {"seconds": _summary(loads)}
            remove(path)
        if "sync" in args.modes:
            results["sync"] = {"blocked_s": _summary(blocked)}
    if "async" in args.modes:
        blocked, total = [], []
        for i in range(args.repeats):
            path = os.path.join(root, f"async_{i}")
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            handle = system.async_save(path)
            _sync(device)
            returned = time.perf_counter() - start
            system.wait(handle)
            _sync(device)
            done = time.perf_counter() - start
            blocked.append(_slowest(returned, device))
            total.append(_slowest(done, device))
            remove(path)
        results["async"] = {"blocked_s": _summary(blocked), "total_s": _summary(total)}
    system.close()

    with torch.device("meta"):  # the full model's size, whatever shards each system holds
        params = sum(p.numel() for p in LlamaModel(cfg).parameters())
    out = {
        "meta": run_meta(device), "args": vars(args), "system": args.system, "world": world, "params": params,
        "checkpoint_bytes": nbytes, "staging": system.staging, "results": results,
    }
    if rank == 0:
        print(json.dumps({"system": args.system, "world": world, "results": {
            mode: {k: round(v["median"], 3) for k, v in r.items()} for mode, r in results.items()}}))
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
