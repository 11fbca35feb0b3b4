"""CPU offload at world 1 on one GPU: a training step of the bench Llama model with its
fp32 master weights, gradients and AdamW state in pinned host memory, for each system in
its own process, and the CPU optimizer step alone.

    python benchmarks/offload.py --configs 1.3b,7b --systems mfsdp,fsdp2,fsdp2_fused --out runs/offload
    python benchmarks/offload.py --optim-bench 1.3b --out runs/offload_optim

Systems (bf16 compute and gathers, fp32 master weights and gradient reduction):
  mfsdp        fully_shard(offload_policy=CPUOffloadPolicy(pin_memory=True)) on every block and
               the root, stepped by megatron_fsdp_ext.optim.CPUAdamW (its bf16 copy-out feeds
               the next gather)
  mfsdp_overlap  the same with CPUAdamW(overlap_step=True): each unit's update runs on a host
               thread while the next forward computes the units updated before it
  fsdp2        torch's fully_shard with the same policy, torch.optim.AdamW at its defaults (on
               host tensors: the single-tensor loop)
  fsdp2_fused  the same with AdamW(fused=True), torch's fastest CPU AdamW
  deepspeed    DeepSpeed ZeRO-Offload (ZeRO stage 2, offload_optimizer to pinned CPU memory,
               its C++ DeepSpeedCPUAdam), where `import deepspeed` works
Per system: init time, the step time (each step ends when the optimizer returned and the
device is idle; forward+backward and the optimizer step timed apart), the device peak over
the measured steps, the process's host peak (ru_maxrss). The optimizer bench steps tensors
shaped like a config's parameters with CPUAdamW (with and without the bf16 copy-out) and
torch's AdamW (foreach, fused, single-tensor), repeats with the spread.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

# name: shape (benchmarks/shapes.py)
CONFIGS = {
    "tiny": shapes.TINY._replace(layers=2, seq=64),
    "1.3b": shapes.LLAMA_1_3B._replace(micro_batch=2),
    "3b": shapes.LLAMA_3B,
    "5b": shapes.LLAMA_7B._replace(layers=24),
    "7b": shapes.LLAMA_7B,
    "8b": shapes.LLAMA_7B._replace(layers=36),
}
SYSTEMS = ("mfsdp", "mfsdp_overlap", "fsdp2", "fsdp2_fused", "deepspeed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(name: str):
    from megatron_fsdp_ext.models import LlamaConfig

    vocab, d, layers, heads, ffn, mb, seq = CONFIGS[name]
    return LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, ffn_hidden=ffn,
                       max_seq_len=seq), mb, seq


def _build(system: str, cfg, device):
    """(step function, model, optimizer) of `system`, initialized on the meta device and
    materialized (DeepSpeed: built on the CPU, as it takes models)."""
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy

    import megatron_fsdp_ext as mfsdp
    from megatron_fsdp_ext.models import LlamaModel

    torch.manual_seed(0)
    if system in ("mfsdp", "mfsdp_overlap"):
        from megatron_fsdp_ext.optim import CPUAdamW

        with torch.device("meta"):
            model = LlamaModel(cfg)
        mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = CPUOffloadPolicy(pin_memory=True)
        for block in model.blocks:
            mfsdp.fully_shard(block, mp_policy=mp, offload_policy=policy)
        mfsdp.fully_shard(model, mp_policy=mp, offload_policy=policy)
        mfsdp.materialize(model)
        opt = CPUAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, overlap_step=system == "mfsdp_overlap")
    elif system in ("fsdp2", "fsdp2_fused"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        with torch.device("meta"):
            model = LlamaModel(cfg)
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = CPUOffloadPolicy(pin_memory=True)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=policy)
        model.to_empty(device="cpu")  # offloaded shards live on the host
        with torch.no_grad():
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                                fused=True if system == "fsdp2_fused" else None)
    elif system == "deepspeed":
        import deepspeed

        model = LlamaModel(cfg)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8)},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
            "zero_allow_untested_optimizer": True,
        }
        engine, opt, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())

        def ds_step(tokens):
            loss = engine.module.loss(tokens, tokens)
            engine.backward(loss)
            return loss

        return ds_step, engine, engine
    else:
        raise SystemExit(f"unknown system {system!r}")

    def step(tokens):
        loss = model.loss(tokens, tokens)
        loss.backward()
        return loss

    return step, model, opt


def child(args) -> dict:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    port = _free_port()
    # torchrun's variables, which DeepSpeed insists on (world 1 here).
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg, mb, seq = _cfg(args.config)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd, model, opt = _build(args.system, cfg, device)
    torch.cuda.synchronize()
    init_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (mb, seq), generator=g).to(device)
    rows, losses = [], []
    wall0 = None
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            wall0 = time.perf_counter()
        t0 = time.perf_counter()
        loss = fwd_bwd(tokens)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        if hasattr(opt, "zero_grad") and args.system != "deepspeed":
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        losses.append(loss.item())
        if i >= args.warmup:
            rows.append({"fwd_bwd_s": t1 - t0, "optim_s": t2 - t1, "step_s": t2 - t0})
    # The clock stops once every launched piece of work is done: an overlapped step's
    # last updates included.
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    torch.cuda.synchronize()
    wall_s = (time.perf_counter() - wall0) / args.steps
    n_params = sum(p.numel() for p in torch.nn.Module.parameters(model.module if args.system == "deepspeed"
                                                                  else model))
    steps = [r["step_s"] for r in rows]
    return {
        "system": args.system, "config": args.config, "micro_batch": mb, "seq": seq,
        "params_in_module": n_params, "init_s": init_s, "step_s_wall": wall_s,
        "step_s_median": statistics.median(steps), "step_s_min": min(steps), "step_s_max": max(steps),
        "fwd_bwd_s_median": statistics.median(r["fwd_bwd_s"] for r in rows),
        "optim_s_median": statistics.median(r["optim_s"] for r in rows),
        "steps": rows, "losses": losses,
        "device_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "device_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "tokens_per_s": mb * seq / wall_s,
    }


def optim_bench(args) -> dict:
    """CPUAdamW against torch's CPU AdamW variants on tensors shaped like the config's
    parameters (fp32, host memory), each variant on fresh tensors, repeats with the spread."""
    import torch

    from megatron_fsdp_ext import optim
    from megatron_fsdp_ext.models import LlamaModel

    cfg, _, _ = _cfg(args.optim_bench)
    with torch.device("meta"):
        shapes = [p.shape for p in LlamaModel(cfg).parameters()]
    numel = sum(s.numel() for s in shapes)
    variants = {
        "cpu_adamw": lambda ps: optim.CPUAdamW(ps, lr=1e-4, weight_decay=0.1),
        "cpu_adamw_bf16_copy": None,  # below: with the copy-out the gather reads
        "torch_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=True),
        "torch_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True),
        "torch_single_tensor": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, foreach=False),
    }
    out = {"config": args.optim_bench, "numel": numel, "threads": torch.get_num_threads(),
           "cpu_optim_threads": optim.num_threads(), "repeats": args.repeats, "variants": {}}
    from megatron_fsdp_ext import _C

    for name, make in variants.items():
        params = [torch.nn.Parameter(torch.randn(s.numel())) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        if make is None:  # the kernel with its bf16 copy-out, as offloaded bf16 units run it
            states = [(torch.zeros_like(p), torch.zeros_like(p), torch.empty(p.numel(), dtype=torch.bfloat16))
                      for p in params]
            hyper = _C.AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                                 decoupled_weight_decay=True, maximize=False)
            counter = [0]

            def run():
                counter[0] += 1
                _C.adam_step([p.detach() for p in params], [p.grad for p in params], [s[0] for s in states],
                             [s[1] for s in states], [s[2] for s in states], [counter[0]] * len(params), hyper)
        else:
            opt = make(params)
            run = opt.step
        run()  # state allocated, pages touched
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        out["variants"][name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                                 "times_s": times}
        print(f"{name:22s} median {statistics.median(times) * 1e3:9.1f} ms  min {min(times) * 1e3:9.1f}  "
              f"max {max(times) * 1e3:9.1f}", flush=True)
        del params
    base = out["variants"]
    out["speedup_vs"] = {k: base[k]["median_s"] / base["cpu_adamw"]["median_s"]
                         for k in ("torch_foreach", "torch_fused", "torch_single_tensor")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1.3b")
    ap.add_argument("--systems", default="mfsdp,fsdp2,fsdp2_fused")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every system this many times, interleaved")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default="runs/offload")
    ap.add_argument("--optim-bench", default=None, help="time the CPU optimizer step alone on this config")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "CONFIG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.system, args.config = args.child
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpus": os.cpu_count(), "command": " ".join([sys.executable] + sys.argv)}
    if args.optim_bench:
        result = {"meta": meta, "optim": optim_bench(args)}
        (out / "offload_optim.json").write_text(json.dumps(result, indent=1))
        return
    rows = []
    for r in range(args.rounds):
        for config in args.configs.split(","):
            for system in args.systems.split(","):
                cmd = [sys.executable, __file__, "--child", system, config, "--steps", str(args.steps),
                       "--warmup", str(args.warmup)]
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    text, code = proc.stdout + proc.stderr, proc.returncode
                except subprocess.TimeoutExpired as e:
                    text, code = f"timed out after {args.timeout}s: {e.stdout or ''}{e.stderr or ''}", -1
                line = next((l for l in text.splitlines() if l.startswith("RESULT ")), None)
                if line is not None:
                    row = dict(json.loads(line[7:]), round=r)
                    print(f"{config:5s} {system:13s} step {row['step_s_wall']:7.3f} s (wall/steps; per step median "
                          f"{row['step_s_median']:.3f} "
                          f"[{row['step_s_min']:.3f}, {row['step_s_max']:.3f}])  fwd+bwd {row['fwd_bwd_s_median']:.3f}  "
                          f"optim {row['optim_s_median']:.3f}  device peak {row['device_peak_gib']:.1f} GiB  "
                          f"host {row['host_peak_gib']:.1f} GiB  init {row['init_s']:.0f} s", flush=True)
                else:
                    tail = "\n".join(text.strip().splitlines()[-12:])
                    row = {"system": system, "config": config, "round": r, "failed": True, "exit_code": code,
                           "error_tail": tail, "wall_s": time.perf_counter() - t0}
                    print(f"{config:5s} {system:12s} FAILED (exit {code}):\n{tail}", flush=True)
                rows.append(row)
                (out / "offload.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
