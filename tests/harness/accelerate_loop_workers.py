"""Workers of tests/distributed/test_accelerate_loop.py: Hugging Face Accelerate's whole
training loop on its FSDP2 path, ours patched in as a user swaps it
(torch.distributed.fsdp.fully_shard = megatron_fsdp_ext.fully_shard), against FSDP2 run
the same way in the same processes, on a tiny LlamaForCausalLM with AdamW:

- `accelerator.accumulate(model)` with gradient_accumulation_steps=2 (no_sync: FSDP2's
  set_requires_gradient_sync(False) on the micro-batch that does not step; or
  sync_each_batch), `accelerator.backward`;
- `accelerator.clip_grad_norm_(model.parameters(), max_norm)` (torch's clip on the
  parameters): its returned norm on every rank, the full gradients before and after it;
- an lr scheduler, train and eval dataloaders prepared by Accelerate,
  `gather_for_metrics` of per-sample eval losses (an uneven last batch: its padding is
  dropped), `model.eval()` + `torch.no_grad()` evaluation between steps and between two
  micro-batches of one accumulation;
- `accelerator.get_state_dict` mid-training and after, `save_model` (sharded
  safetensors), `unwrap_model`, `free_memory`;
- `save_state` (SHARDED_STATE_DICT and FULL_STATE_DICT) after the first epoch, and
  `load_state` into a fresh Accelerator, model and optimizer (any saver, any loader).

Accelerate takes the job from torchrun's environment variables (RANK, WORLD_SIZE, ...):
they are set from the process group, so it sees 2 processes (its dataloaders shard, its
gather gathers). On CPU it makes the job MULTI_CPU and would ignore its FSDP plugin: the
distributed type is set to FSDP after construction (as in convert_workers), so prepare(),
clip_grad_norm_, no_sync, save_state and load_state run the FSDP2 code unchanged.

Results leave as numpy arrays (tensors would leave through shared memory that the
exiting rank takes with it). Full values (gradients, parameters, state dicts) come from
rank 0; norms, learning rates and eval metrics from every rank."""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.fsdp import fully_shard as FSDP2_FULLY_SHARD

import megatron_fsdp_ext as mfsdp

from .workers import torchrun_environment

VOCAB, SEQ, BATCH = 128, 16, 2
N_TRAIN, N_EVAL = 24, 5  # 12 batches: 6 a rank, 3 optimizer steps an epoch; eval: 3 + 2 (uneven)
ACCUM, EPOCHS = 2, 2
MAX_NORM = 0.5  # below every step's gradient norm (1.3-2.2): the clip scales each step
SYSTEMS = ("fsdp2", "ours")
STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")


def _np(t) -> np.ndarray:
    return torch.as_tensor(t).detach().float().cpu().clone().numpy()


def _full(t: torch.Tensor) -> torch.Tensor:
    # Both systems' sharded parameters and gradients answer full_tensor() (a collective).
    # FSDP2's DTensors gather through plain c10d collectives (gather_dtensor): torch's
    # functional collectives behind DTensor.full_tensor() once crashed a rank here on
    # Gloo (SIGSEGV in wait_tensor, CPU) between the launch's several Accelerators.
    from torch.distributed.tensor import DTensor

    if type(t) is DTensor:  # FSDP2's (its parameters too); ours present as DTensors by subclass
        from megatron_fsdp_ext.core.state_dict import gather_dtensor
        return gather_dtensor(t.detach())
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _tree_np(x):
    if isinstance(x, dict):
        return {k: _tree_np(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_tree_np(v) for v in x]
    if torch.is_tensor(x):
        return _np(_full(x))
    return x


def train_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N_TRAIN, SEQ), generator=torch.Generator().manual_seed(1234))


def eval_data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (N_EVAL, SEQ), generator=torch.Generator().manual_seed(4321))


def llama(seed: int, tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + 0.25 * step)


def per_sample_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1),
                                             reduction="none")
    return loss.view(ids.shape[0], -1).mean(1)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _accelerator(state_dict_type: str, sync_each_batch: bool):
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, GradientAccumulationPlugin
    world, rank = dist.get_world_size(), dist.get_rank()
    torchrun_environment(rank, world, OMP_NUM_THREADS="1")
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        state_dict_type=state_dict_type)
    acc = Accelerator(cpu=True, mixed_precision="no", fsdp_plugin=plugin,
                      gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=ACCUM,
                                                                               sync_each_batch=sync_each_batch))
    if acc.distributed_type != DistributedType.FSDP:
        acc.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
    assert acc.is_fsdp2 and acc.num_processes == world and acc.process_index == rank
    return acc


class Run:
    """One prepared Accelerator, model, optimizer, scheduler and dataloaders under
    `system`'s fully_shard (patched in for the whole run, as a user's script does)."""

    def __init__(self, system: str, seed: int, state_dict_type: str = "SHARDED_STATE_DICT",
                 sync_each_batch: bool = False, tie: bool = False):
        from torch.utils.data import DataLoader
        torch_fsdp.fully_shard = mfsdp.fully_shard if system == "ours" else FSDP2_FULLY_SHARD
        self.system, self.rank = system, dist.get_rank()
        self.acc = _accelerator(state_dict_type, sync_each_batch)
        model = llama(seed, tie)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        train = DataLoader(train_data(), batch_size=BATCH, shuffle=False)
        evals = DataLoader(eval_data(), batch_size=BATCH, shuffle=False)
        self.model, self.opt, self.sched, self.train, self.evals = self.acc.prepare(model, opt, sched, train, evals)
        sharded_as = mfsdp.FSDPModule if system == "ours" else torch_fsdp.FSDPModule
        assert isinstance(self.model, sharded_as) and isinstance(self.model.model.layers[0], sharded_as)
        assert (self.model.lm_head.weight is self.model.model.embed_tokens.weight) == tie

    def close(self) -> None:
        self.acc.free_memory(self.model, self.opt, self.sched)
        self.model = self.opt = self.sched = None
        torch_fsdp.fully_shard = FSDP2_FULLY_SHARD
        _reset_accelerate()

    def full_params(self) -> dict:
        return {n: _np(_full(p)) for n, p in self.model.named_parameters()}

    def evaluate(self) -> np.ndarray:
        self.model.eval()
        out = []
        with torch.no_grad():
            for ids in self.evals:
                out.append(self.acc.gather_for_metrics(per_sample_loss(self.model(input_ids=ids).logits, ids)))
        self.model.train()
        return _np(torch.cat(out))

    def optim_state(self) -> dict:
        """The optimizer's state in full (FQN keys), as torch's state-dict helper gives it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        osd = get_optimizer_state_dict(self.model, self.opt,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _tree_np(osd) if self.rank == 0 else sorted(osd)

    def epoch(self, rec: dict, eval_mid: bool = False, save_mid: bool = False) -> None:
        """One pass over the train dataloader, as a typical Accelerate script writes it."""
        acc, model, rank = self.acc, self.model, self.rank
        for ids in self.train:
            with acc.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                rec["losses"].append(loss.item())
                rec["batches"].append(ids[:, 0].tolist())
                if acc.sync_gradients:
                    step = {"grad_pre": {n: _np(_full(p.grad)) for n, p in model.named_parameters()}}
                    norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM)
                    step["norm"] = norm.item()
                    step["grad_post"] = {n: _np(_full(p.grad)) for n, p in model.named_parameters()}
                    step["lr"] = self.sched.get_last_lr()[0]
                else:
                    # FSDP2 leaves .grad None under no_sync (the unsharded gradients wait for
                    # the next backward); with sync_each_batch it holds the reduced gradient.
                    mid = {n: None if p.grad is None else _np(_full(p.grad)) for n, p in model.named_parameters()}
                    rec["mid_grads"].append(mid if rank == 0 else {n: g is None for n, g in mid.items()})
                    if eval_mid:
                        rec["eval_mid"].append(self.evaluate())
                self.opt.step()
                self.sched.step()
                self.opt.zero_grad()
                if acc.sync_gradients:
                    step["params"] = self.full_params()
                    step["eval"] = self.evaluate()
                    if save_mid and len(rec["steps"]) == 1:
                        sd = acc.get_state_dict(model)
                        step["state_dict"] = _tree_np(sd) if rank == 0 else sorted(sd)
                    if rank != 0:
                        step = {k: step[k] for k in ("norm", "lr", "eval", "state_dict") if k in step}
                    rec["steps"].append(step)


def _new_record() -> dict:
    return {"losses": [], "batches": [], "steps": [], "mid_grads": [], "eval_mid": []}


def _read_checkpoint(path: str, state_dict_type: str) -> dict:
    """What save_state wrote for the model and optimizer, read back in full (rank 0)."""
    if state_dict_type == "FULL_STATE_DICT":
        return {name: _tree_np(torch.load(os.path.join(path, f"{name}.bin"), weights_only=True))
                for name in ("pytorch_model_fsdp", "optimizer")}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {}
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        dst = os.path.join(path, f"{name}.pt")
        dcp_to_torch_save(os.path.join(path, name), dst)
        out[name] = _tree_np(torch.load(dst, weights_only=False))
    return out


def accelerate_loop(rank: int, world: int, root: str) -> dict:
    """Per system, the uninterrupted loop: EPOCHS epochs of accumulate + backward + clip +
    step + scheduler + eval (also between micro-batches), a get_state_dict after the
    second step; save_state in both state-dict types after the first epoch (into
    root/<system>/<type>); after the last epoch get_state_dict, save_model (several
    safetensors files), unwrap_model, the optimizer's full state, and one more backward
    whose inf-norm clip_grad_norm_ (max_norm not reached) is returned beside the true
    max |g| of the full gradients. Rank 0 then runs the single-process reference."""
    out = {}
    for system in SYSTEMS:
        run = Run(system, seed=0)
        try:
            rec = _new_record()
            rec["eval0"] = run.evaluate()
            for e in range(EPOCHS):
                run.epoch(rec, eval_mid=True, save_mid=e == 0)
                if e == 0:
                    rec["checkpoints"] = {}
                    for sd_type in STATE_DICT_TYPES:
                        run.acc.state.fsdp_plugin.set_state_dict_type(sd_type)
                        path = os.path.join(root, system, sd_type)
                        run.acc.save_state(path)
                        run.acc.wait_for_everyone()
                        if rank == 0:
                            rec["checkpoints"][sd_type] = _read_checkpoint(path, sd_type)
                    run.acc.state.fsdp_plugin.set_state_dict_type("SHARDED_STATE_DICT")
            sd = run.acc.get_state_dict(run.model)
            rec["state_dict"] = _tree_np(sd) if rank == 0 else sorted(sd)
            model_dir = os.path.join(root, system, "model")
            run.acc.save_model(run.model, model_dir, max_shard_size="100KB")
            run.acc.wait_for_everyone()
            if rank == 0:
                from safetensors.torch import load_file
                files = sorted(os.listdir(model_dir))
                rec["save_model_files"] = files
                rec["safetensors"] = {k: _np(v) for f in files if f.endswith(".safetensors")
                                      for k, v in load_file(os.path.join(model_dir, f)).items()}
            unwrapped = run.acc.unwrap_model(run.model)
            rec["unwrapped"] = {"type": type(unwrapped).__name__, "is_prepared_model": unwrapped is run.model,
                                "state_dict": {k: _np(_full(v)) for k, v in unwrapped.state_dict().items()}}
            rec["optim_final"] = run.optim_state()
            ids = train_data()[:BATCH]
            run.acc.backward(run.model(input_ids=ids, labels=ids).loss)
            norm = run.acc.clip_grad_norm_(run.model.parameters(), 1e9, norm_type=float("inf"))
            rec["inf_norm"] = norm.item()
            rec["max_abs_grad"] = max(_full(p.grad).abs().max().item() for p in run.model.parameters())
            run.opt.zero_grad()
        finally:
            run.close()
        out[system] = rec
    if rank == 0:
        out["one_process"] = one_process_reference(world)
    return out


def accelerate_resume(rank: int, world: int, root: str, cases) -> dict:
    """For each (saver, loader, state_dict_type) of `cases`: a fresh Accelerator, model
    (another seed) and optimizer under `loader`, load_state of what `saver`'s
    accelerate_loop saved after its first epoch, then its second epoch: right after the
    load, the full parameters, the lr, the optimizer's full state; then the epoch's
    records."""
    out = {}
    for saver, loader, sd_type in cases:
        run = Run(loader, seed=1, state_dict_type=sd_type)
        try:
            run.acc.load_state(os.path.join(root, saver, sd_type))
            rec = _new_record()
            rec["after_load"] = {"params": run.full_params(), "lr": run.sched.get_last_lr()[0],
                                 "optim": run.optim_state()}
            run.epoch(rec)
            sd = run.acc.get_state_dict(run.model)
            rec["state_dict"] = _tree_np(sd) if rank == 0 else sorted(sd)
        finally:
            run.close()
        out[(saver, loader, sd_type)] = rec
    return out


def accelerate_sync_each_batch(rank: int, world: int) -> dict:
    """Per system, one epoch with sync_each_batch (every micro-batch's gradient reduced
    and accumulated into the sharded gradient) on a model whose lm_head is tied to its
    embedding, then get_state_dict."""
    out = {}
    for system in SYSTEMS:
        run = Run(system, seed=0, sync_each_batch=True, tie=True)
        try:
            rec = _new_record()
            run.epoch(rec)
            sd = run.acc.get_state_dict(run.model)
            rec["state_dict"] = _tree_np(sd) if rank == 0 else sorted(sd)
        finally:
            run.close()
        out[system] = rec
    return out


def one_process_reference(world: int) -> dict:
    """The same loop in one plain process over the whole batch: per optimizer step the
    ACCUM micro-batches of every rank (rank r's k-th batch is global batch k*world + r, as
    Accelerate's dataloader shards them), each loss over ACCUM*world, torch's clip, AdamW,
    the scheduler stepped `world` times (as Accelerate's scheduler does without
    split_batches). No fully_shard anywhere."""
    model = llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    batches = train_data().split(BATCH)
    evals = eval_data()

    def evaluate():
        model.eval()
        with torch.no_grad():
            loss = per_sample_loss(model(input_ids=evals).logits, evals)
        model.train()
        return _np(loss)

    rec = {"losses": [[] for _ in range(world)], "steps": [], "eval0": evaluate()}
    per_rank = len(batches) // world
    for _ in range(EPOCHS):
        for first in range(0, per_rank, ACCUM):
            for k in range(first, first + ACCUM):
                for r in range(world):
                    ids = batches[k * world + r]
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / (ACCUM * world)).backward()
                    rec["losses"][r].append(loss.item())
            step = {"grad_pre": {n: _np(p.grad) for n, p in model.named_parameters()}}
            step["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
            step["grad_post"] = {n: _np(p.grad) for n, p in model.named_parameters()}
            step["lr"] = sched.get_last_lr()[0]
            opt.step()
            for _ in range(world):
                sched.step()
            opt.zero_grad()
            step["params"] = {n: _np(p) for n, p in model.named_parameters()}
            step["eval"] = evaluate()
            rec["steps"].append(step)
    rec["batches"] = [[b[:, 0].tolist() for k, b in enumerate(batches) if k % world == r] for r in range(world)]
    return rec
