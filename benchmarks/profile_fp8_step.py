"""One profiled training step of ours on the 1.3b bench model with torchao Float8Linear
blocks, compiled (inductor), rank 0 of a fake world: the FP8 gather against the bf16
gather. Prints the top kernels by GPU time and the top host ops.

    python3 benchmarks/profile_fp8_step.py gather 8     # enable_fsdp_float8_all_gather=True
    python3 benchmarks/profile_fp8_step.py bf16 8       # weights gathered in bf16
"""
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel

gather = sys.argv[1] == "gather"
world = int(sys.argv[2])
torch.cuda.set_device(0)
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
cfg = LlamaConfig(vocab_size=32000, d_model=2048, n_layers=24, n_heads=16, ffn_hidden=5504, max_seq_len=2048)
with torch.device("meta"):
    model = LlamaModel(cfg)
convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=gather),
                           module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
mp = mfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for b in model.blocks:
    mfsdp.fully_shard(b, mp_policy=mp)
mfsdp.fully_shard(model, mp_policy=mp)
mfsdp.materialize(model)
for b in model.blocks:
    b.compile()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
data = torch.randint(0, 32000, (4, 2049), device="cuda")


def step():
    logits = model(data[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 32000), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(4):  # compile, then warm
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3
print(f"== {sys.argv[1]} W={world}: step {ms:.1f} ms")
print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
