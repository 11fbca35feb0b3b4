"""torchtitan 0.3.0's own checkpoint code on our fully_shard, against FSDP2 with the same code.

Its CheckpointManager (torchtitan/components/checkpointer/dcp.py) as its Trainer uses it:
`save(step, last_step=...)` after each train_step, `maybe_wait_for_staging()` inside
train_step, `load(step)` in a fresh job, `maybe_wait_for_saving()` / `close()` at the end,
its ModelWrapper (a cached state dict that it refreshes in place with `copy_` at each save:
under FSDP2 the cached values are the parameters' storage, under ours copies), its
OptimizersContainer's flat optimizer state dict, its LR schedulers and a small stateful
data source (for its "dataloader" entry; no torchdata), its last-step export
(`last_save_model_only`, `export_dtype`, `last_save_in_hf` with the llama3 state-dict adapter)
and its initial HF load. Async modes: "disabled" and "async" (a thread); "async_with_pinned_mem"
needs an accelerator (torch's DefaultStager refuses non-blocking copies without one: an
AssertionError in its constructor, the same under both systems) and is not run here.

Also torch's own `dcp.async_save` of `{"model": get_model_state_dict, "optim":
get_optimizer_state_dict}` while training continues, loaded back through `dcp.load` +
`set_model_state_dict` / `set_optimizer_state_dict` in a fresh job.

Every comparison is of ours against FSDP2 on the same ranks and against the uninterrupted
run: per-step loss, max local loss, grad norm and lr as train_step logs them, every
parameter's full (clipped) gradient taken between backward and the optimizer step
(`p.grad.full_tensor()`, on both systems), and every parameter after the last step.

"Values at save time" is made deterministic: the checkpoint writes of an async save block
(gate_checkpoint_writes) until the job has trained the next step, so a save that kept
references to live storage instead of copies would write the later values.
"""
from __future__ import annotations

import glob
import os
import shutil
import threading
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate

from . import titan_workers as tw
from .tp_workers import plain_name
from .workers import rel_err

IMPLS = ("fsdp2", "ours")
TOL = 1e-5  # relative: losses, grad norms, gradients (per parameter, norm-relative), parameters


# ---------------------------------------------------------------- helpers

class WriteGate:
    """Holds every checkpoint file write (torch's FileSystemWriter.write_data, which an
    async save runs on its background thread) until open() is called."""

    def __init__(self):
        from torch.distributed.checkpoint import filesystem as fs

        self.event = threading.Event()
        self.waited = 0
        self._fs = fs
        self._original = fs._FileSystemWriter.write_data
        gate = self

        def write_data(writer, plan, planner):
            if not gate.event.is_set():
                gate.waited += 1
                assert gate.event.wait(timeout=120), "checkpoint write gate never opened"
            return gate._original(writer, plan, planner)

        fs._FileSystemWriter.write_data = write_data

    def open(self) -> None:
        self.event.set()

    def remove(self) -> None:
        self.event.set()
        self._fs._FileSystemWriter.write_data = self._original


def capture_grads(t) -> List[Dict[str, torch.Tensor]]:
    """Every step's full gradients, taken where train_step calls optimizers.step() (after
    its clip_grad_norm_): `p.grad.full_tensor()`, the same call on FSDP2 and on ours."""
    log: List[Dict[str, torch.Tensor]] = []
    step = t.optimizers.step

    def logged_step(*args, **kwargs):
        log.append({plain_name(n): p.grad.full_tensor().detach().double().cpu().clone()
                    for m in t.model_parts for n, p in m.named_parameters()})
        return step(*args, **kwargs)

    t.optimizers.step = logged_step
    return log


def full_params(t, impl: str) -> Dict[str, torch.Tensor]:
    """Every parameter, whole: FSDP2's full_tensor(), ours rebuilt from the ranks' pieces
    (no TP in these jobs)."""
    m = t.model_parts[0]
    return tw._full_params(m, impl, None, {plain_name(n): (Replicate(),) for n, _ in m.named_parameters()})


def fsdp2_state_dict(t) -> Dict[str, torch.Tensor]:
    """FSDP2's model.state_dict() (its fused-qkv hooks split wqkv), whole."""
    return {k: v.full_tensor().detach().double().cpu() if hasattr(v, "full_tensor") else v.detach().double().cpu()
            for k, v in t.model_parts[0].state_dict().items()}


def read_checkpoint(path: str) -> Dict[str, object]:
    """A DCP checkpoint read whole on every rank (torch's _load_state_dict_from_keys)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(checkpoint_id=path)


def remove_when_done(path: str) -> None:
    """After a worker passed: its checkpoints (~100 MB a job) go, once every rank is done."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _max_rel(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> float:
    assert sorted(got) == sorted(want), f"{what}: keys {sorted(set(got) ^ set(want))[:6]} differ"
    return max(rel_err(got[k].double().reshape(want[k].shape), want[k].double()) for k in want)


def _max_abs(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> float:
    return max((got[k].double().reshape(want[k].shape) - want[k].double()).abs().max().item() for k in want)


def compare_runs(rows, grads, params, ref_rows, ref_grads, ref_params, what: str, worst: Dict,
                 tol: float = TOL) -> None:
    """Rows (loss, max_loss, grad_norm within tol; lr equal), each step's full gradients
    and the final parameters, against a reference run's (the same steps)."""
    assert len(rows) == len(ref_rows) and len(grads) == len(ref_grads), \
        f"{what}: {len(rows)} steps ({len(grads)} gradient sets) vs {len(ref_rows)} ({len(ref_grads)})"
    for got, ref in zip(rows, ref_rows):
        tw._compare_rows(got, ref, got["step"], tol, worst, what)
    for i, (g, ref) in enumerate(zip(grads, ref_grads)):
        e = _max_rel(g, ref, f"{what}: gradients")
        worst["grad"] = max(worst.get("grad", 0.0), e)
        assert e <= tol, f"{what}: gradients of step {rows[i]['step']} rel err {e:.2e}"
    e = _max_rel(params, ref_params, f"{what}: parameters")
    worst["param"] = max(worst.get("param", 0.0), e)
    assert e <= tol, f"{what}: parameters after step {rows[-1]['step']} rel err {e:.2e}"


# ---------------------------------------------------------------- its CheckpointManager

def titan_manager_resume(rank: int, world: int, folder: str, mode: str, save_at: int = 2, steps: int = 4,
                         export_dtype: str = "bfloat16", fuse_qkv: bool = True, tol: float = TOL) -> Dict:
    """torchtitan's CheckpointManager (`mode`: "disabled" or "async") on the debugmodel job
    (fused wqkv by default), FSDP2 and ours on the same ranks:

    1. Both train `steps` steps through train_step + checkpointer.save (interval
       `save_at`; the last step exports the model only in `export_dtype`): ours equals
       FSDP2 (rows, gradients, parameters). In "async" the step-`save_at` save is still
       in flight after the next step has trained (its writes gated), then
       maybe_wait_for_staging / maybe_wait_for_saving / close.
    2. The step-`save_at` checkpoint holds the values at save time (FSDP2's state dict
       then, ours' own parameters then), far from those one step later.
    3. The export: model keys only, `export_dtype`, each system's final parameters cast;
       ours' equals FSDP2's within one rounding of the export dtype.
    4. Fresh jobs (new model, optimizer, LR schedulers, data, manager) load step `save_at`
       and train to `steps`: ours from ours, FSDP2 from FSDP2, ours from FSDP2's, FSDP2
       from ours', each equal to the uninterrupted run of the system that saved.
    5. The same job loads step `save_at` again and retrains: equal to its first pass."""
    from torchtitan.components.checkpoint import CheckpointManager

    dims, cfg = tw._setup(world, {"data_parallel_shard_degree": world}, steps=steps, max_norm=0.25, local_bs=2,
                          accum=1, loss="ce", ac=False, fuse_qkv=fuse_qkv)
    where = {impl: os.path.join(folder, mode, impl) for impl in IMPLS}
    gate = WriteGate() if mode != "disabled" else None
    worst: Dict[str, float] = {}
    out: Dict[str, object] = {"mode": mode}
    try:
        runs, grads, rows, at_save, later = {}, {}, {}, {}, {}
        for impl in IMPLS:
            c = CheckpointManager.Config(enable=True, folder=where[impl], interval=save_at, keep_latest_k=0,
                                         async_mode=mode, last_save_model_only=True, export_dtype=export_dtype)
            runs[impl] = tw._titan_trainer(cfg, dims, impl, checkpoint=c)
            grads[impl], rows[impl] = capture_grads(runs[impl]), []
        for step in range(1, steps + 1):
            for impl in IMPLS:
                t = runs[impl]
                rows[impl] += tw._train(t, 1)
                if step == save_at:
                    at_save[impl] = {"params": full_params(t, impl)}
                    if impl == "fsdp2":
                        at_save[impl]["state_dict"] = fsdp2_state_dict(t)
                if step == save_at + 1:
                    later[impl] = full_params(t, impl)
            tw._compare_rows(rows["ours"][-1], rows["fsdp2"][-1], step, tol, worst)
            if gate is not None and step == save_at + 1:
                # The next step has trained (and changed every parameter and moment) while
                # the step-save_at save has written nothing yet.
                for impl in IMPLS:
                    fut = runs[impl].checkpointer.save_future
                    assert fut is not None and not fut.done(), f"{impl}: no async save in flight at step {step}"
                gate.open()
        for impl in IMPLS:
            cp = runs[impl].checkpointer
            cp.maybe_wait_for_staging()
            cp.maybe_wait_for_saving()
            assert cp.save_future is None, f"{impl}: save_future left after maybe_wait_for_saving"
        if gate is not None:
            out["writes_held"] = gate.waited
            assert gate.waited > 0, "no checkpoint write went through the gate"
        final = {impl: full_params(runs[impl], impl) for impl in IMPLS}
        compare_runs(rows["ours"], grads["ours"], final["ours"], rows["fsdp2"], grads["fsdp2"], final["fsdp2"],
                     "ours vs FSDP2 (uninterrupted)", worst, tol)

        # 2. What the step-save_at checkpoint holds.
        ref_sd = at_save["fsdp2"]["state_dict"]
        for impl in IMPLS:
            held = read_checkpoint(os.path.join(where[impl], f"step-{save_at}"))
            model = {k: v for k, v in held.items() if k in ref_sd}
            e = _max_rel(model, ref_sd, f"{impl}'s step-{save_at} checkpoint vs FSDP2's state dict at save time")
            worst[f"ckpt_{impl}_vs_save_time"] = e
            assert e <= tol, f"{impl}'s step-{save_at} checkpoint vs the values at save time: rel err {e:.2e}"
            own = {k: v for k, v in held.items() if k in at_save[impl]["params"]}
            assert len(own) >= len(ref_sd) // 2, f"{impl}: only {len(own)} checkpoint keys are parameter names"
            exact = _max_abs(own, {k: at_save[impl]["params"][k] for k in own})
            assert exact == 0.0, f"{impl}'s step-{save_at} checkpoint vs its own parameters at save time: {exact}"
            moved = _max_abs(own, {k: later[impl][k] for k in own})
            worst[f"ckpt_{impl}_vs_one_step_later"] = moved
            assert moved > 1e-4, f"{impl}: the values one step later are as saved ({moved}): nothing was checked"
            for key in ("optimizer", "lr_scheduler", "dataloader", "train_state"):
                assert any(k == key or k.startswith(key + ".") for k in held), f"{impl}: no '{key}' in the checkpoint"

        # 3. The last-step export.
        exports = {}
        for impl in IMPLS:
            exported = read_checkpoint(os.path.join(where[impl], f"step-{steps}"))
            exports[impl] = exported
            assert sorted(exported) == sorted(ref_sd), \
                f"{impl}'s export keys {sorted(set(exported) ^ set(ref_sd))[:6]}: not the model's alone"
            dtype = getattr(torch, export_dtype)
            assert all(v.dtype == dtype for v in exported.values()), f"{impl}: export dtypes " \
                f"{sorted({str(v.dtype) for v in exported.values()})}, not {dtype}"
            own = {k: final[impl][k].to(dtype) for k in exported if k in final[impl]}
            assert _max_abs({k: exported[k] for k in own}, own) == 0.0, \
                f"{impl}'s export is not its final parameters cast to {dtype}"
        ulp = torch.finfo(getattr(torch, export_dtype)).eps
        e = max(((exports["ours"][k].double() - exports["fsdp2"][k].double()).abs()
                 / exports["fsdp2"][k].double().abs().clamp_min(1e-6)).max().item() for k in exports["fsdp2"])
        worst["export_elementwise"] = e
        assert e <= max(2 * ulp, tol), f"ours' export vs FSDP2's: element-wise rel diff {e:.2e}"

        # 4. Fresh jobs resume from each system's checkpoint.
        for impl in IMPLS:
            for src in IMPLS:
                c = CheckpointManager.Config(enable=True, folder=where[src], load_only=True, keep_latest_k=0,
                                             async_mode=mode)
                t = tw._titan_trainer(cfg, dims, impl, checkpoint=c)
                g = capture_grads(t)
                assert t.checkpointer.load(step=save_at), f"{impl}: nothing loaded from {src}'s checkpoint"
                assert t.step == save_at and t.dataloader.step == save_at, f"{impl} resumed at step {t.step}"
                after_load = full_params(t, impl)
                e = _max_rel(after_load, at_save[src]["params"], f"{impl} loaded from {src}")
                assert e <= tol, f"{impl} after loading {src}'s step {save_at}: rel err {e:.2e} vs {src} then"
                r = tw._train(t, steps - save_at)
                compare_runs(r, g, full_params(t, impl), rows[src][save_at:], grads[src][save_at:], final[src],
                             f"{impl} resumed from {src}'s checkpoint vs {src} uninterrupted", worst, tol)
                t.checkpointer.close()

        # 5. The same job loads the step again and retrains.
        for impl in IMPLS:
            t, first = runs[impl], len(grads[impl])
            assert t.checkpointer.load(step=save_at), f"{impl}: reload of step {save_at} in the same job failed"
            assert t.step == save_at
            r = tw._train(t, steps - save_at)
            t.checkpointer.maybe_wait_for_saving()
            compare_runs(r, grads[impl][first:], full_params(t, impl), rows[impl][save_at:],
                         grads[impl][save_at:first], final[impl], f"{impl} reloaded in the same job", worst, tol)
            t.checkpointer.close()
    finally:
        if gate is not None:
            gate.remove()
    out["worst"] = worst
    out["losses"] = {impl: [r["loss"] for r in rows[impl]] for impl in IMPLS}
    remove_when_done(os.path.join(folder, mode))
    return out


def titan_hf_export_and_initial_load(rank: int, world: int, folder: str, steps: int = 2,
                                     tol: float = TOL) -> Dict:
    """The last-step export in Hugging Face safetensors (`last_save_in_hf` through the
    llama3 state-dict adapter: q/k permuted on the DTensors, fused wqkv split by its
    hooks; consolidated into one file) from FSDP2 and from ours: equal files. Then a
    fresh job of each loads either export as its initial checkpoint
    (`initial_load_path`, `initial_load_in_hf`): the parameters of the run that exported."""
    from safetensors.torch import load_file
    from torchtitan.components.checkpoint import CheckpointManager

    dims, cfg = tw._setup(world, {"data_parallel_shard_degree": world}, steps=steps, max_norm=0.25, local_bs=2,
                          accum=1, loss="ce", ac=False)
    spec = cfg.model_spec

    def manager(t, **kw):
        return CheckpointManager.Config(enable=True, keep_latest_k=0, **kw).build(
            dataloader=t.dataloader, model_parts=t.model_parts, optimizers=t.optimizers,
            lr_schedulers=t.lr_schedulers, states={"train_state": t},
            sd_adapter=spec.state_dict_adapter(spec.model, None), base_folder="")

    where = {impl: os.path.join(folder, "hf", impl) for impl in IMPLS}
    final, files = {}, {}
    for impl in IMPLS:
        t = tw._titan_trainer(cfg, dims, impl)
        t.checkpointer = manager(t, folder=where[impl], interval=1000, last_save_model_only=True,
                                 last_save_in_hf=True)
        tw._train(t, steps)
        t.checkpointer.close()
        final[impl] = full_params(t, impl)
    dist.barrier()
    worst: Dict[str, float] = {}
    for impl in IMPLS:
        tensors: Dict[str, torch.Tensor] = {}
        for f in sorted(glob.glob(os.path.join(where[impl], f"step-{steps}", "*.safetensors"))):
            tensors.update(load_file(f))
        assert tensors, f"{impl}: no safetensors in its export"
        files[impl] = tensors
    assert sorted(files["ours"]) == sorted(files["fsdp2"]), "HF export keys differ"
    worst["hf_export"] = _max_rel(files["ours"], files["fsdp2"], "HF export ours vs FSDP2")
    assert worst["hf_export"] <= tol, f"ours' HF export vs FSDP2's: rel err {worst['hf_export']:.2e}"
    for impl in IMPLS:
        for src in IMPLS:
            t = tw._titan_trainer(cfg, dims, impl)
            t.checkpointer = manager(t, folder=os.path.join(folder, "hf_fresh", impl + "_" + src), load_only=True,
                                     initial_load_path=os.path.join(where[src], f"step-{steps}"),
                                     initial_load_in_hf=True, initial_load_model_only=True)
            assert t.checkpointer.load(), f"{impl}: nothing loaded from {src}'s HF export"
            e = _max_rel(full_params(t, impl), final[src], f"{impl} loaded {src}'s HF export")
            worst[f"{impl}_from_{src}_hf"] = e
            assert e <= tol, f"{impl} after loading {src}'s HF export vs {src}'s final parameters: rel err {e:.2e}"
            t.checkpointer.close()
    remove_when_done(os.path.join(folder, "hf"))
    return {"worst": worst, "keys": len(files["ours"])}


# ---------------------------------------------------------------- torch's dcp.async_save

def torch_async_save_resume(rank: int, world: int, folder: str, save_at: int = 2, steps: int = 4,
                            tol: float = TOL) -> Dict:
    """torch's dcp.async_save of {"model": get_model_state_dict(model), "optim":
    get_optimizer_state_dict(model, optimizers)} on a Gloo group of its own (as torchtitan's
    manager does; on the training's own group, the save's collectives in its thread
    interleave with the training's: FSDP2 aborts in Gloo, ours hangs), its writes held until the next
    step has trained; then in fresh jobs dcp.load into the same helpers' state dicts,
    set_model_state_dict / set_optimizer_state_dict, the LR schedule and data position
    restored by hand: equal to the uninterrupted run, ours and FSDP2, both ways."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    dims, cfg = tw._setup(world, {"data_parallel_shard_degree": world}, steps=steps, max_norm=0.25, local_bs=2,
                          accum=1, loss="ce", ac=False, fuse_qkv=False)
    # One Gloo group per system's save: the two saves are in flight together, and each
    # runs its collectives on its own thread.
    groups = {impl: dist.new_group(backend="gloo") for impl in IMPLS}
    where = {impl: os.path.join(folder, "torch_async", impl) for impl in IMPLS}
    gate = WriteGate()
    worst: Dict[str, float] = {}
    try:
        runs, grads, rows, at_save, later, futures = {}, {}, {}, {}, {}, {}
        for impl in IMPLS:
            runs[impl] = tw._titan_trainer(cfg, dims, impl)
            grads[impl], rows[impl] = capture_grads(runs[impl]), []
        for step in range(1, steps + 1):
            for impl in IMPLS:
                t = runs[impl]
                rows[impl] += tw._train(t, 1)
                if step == save_at:
                    m, opts = t.model_parts[0], list(t.optimizers.optimizers)
                    state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opts)}
                    at_save[impl] = full_params(t, impl)
                    futures[impl] = dcp.async_save(state, checkpoint_id=where[impl], process_group=groups[impl])
                    del state
                if step == save_at + 1:
                    later[impl] = full_params(t, impl)
            if step == save_at + 1:
                assert all(not f.done() for f in futures.values()), "an async save finished before its gate opened"
                gate.open()
        for impl in IMPLS:
            futures[impl].result()
        assert gate.waited > 0, "no checkpoint write went through the gate"
        final = {impl: full_params(runs[impl], impl) for impl in IMPLS}
        compare_runs(rows["ours"], grads["ours"], final["ours"], rows["fsdp2"], grads["fsdp2"], final["fsdp2"],
                     "ours vs FSDP2 (uninterrupted)", worst, tol)
        for impl in IMPLS:
            held = read_checkpoint(where[impl])["model"]
            own = {k: held[k] for k in at_save[impl]}
            assert _max_abs(own, at_save[impl]) == 0.0, f"{impl}: the async checkpoint is not the values at save time"
            assert _max_abs(own, later[impl]) > 1e-4, f"{impl}: the values one step later are as saved"
        for impl in IMPLS:
            for src in IMPLS:
                t = tw._titan_trainer(cfg, dims, impl)
                g = capture_grads(t)
                m, opts = t.model_parts[0], list(t.optimizers.optimizers)
                state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, opts)}
                dcp.load(state, checkpoint_id=where[src])
                set_model_state_dict(m, state["model"])
                set_optimizer_state_dict(m, opts, state["optim"])
                del state
                t.lr_schedulers.load_state_dict({"last_epoch": save_at})
                t.step = t.dataloader.step = save_at
                e = _max_rel(full_params(t, impl), at_save[src], f"{impl} loaded from {src}")
                assert e <= tol, f"{impl} after loading {src}'s async checkpoint: rel err {e:.2e}"
                r = tw._train(t, steps - save_at)
                compare_runs(r, g, full_params(t, impl), rows[src][save_at:], grads[src][save_at:], final[src],
                             f"{impl} resumed from {src}'s async_save vs {src} uninterrupted", worst, tol)
    finally:
        gate.remove()
    remove_when_done(os.path.join(folder, "torch_async"))
    return {"worst": worst, "writes_held": gate.waited}


# ---------------------------------------------------------------- a change on the parameters' side

def titan_inplace_change_after_manager_built(rank: int, world: int, folder: str, tol: float = TOL) -> Dict:
    """Parameters changed in place after torchtitan's CheckpointManager was built,
    before the first forward: the manager's ModelWrapper keeps `model.state_dict()` (its
    cache; again after every load()). Ours once took any difference between such a held
    value and the live shard for a write into the value (core/state_dict.py `_write_back`)
    and put the old values back at that forward; a held value now counts as written only
    if its own fingerprint changed (handed_out.HandedOutValue.counts_as_written). Under
    FSDP2 the cache is the parameters' storage and sees the change.

    Returns, per system, the first step's loss and the parameters after it, with the
    manager enabled; ours also with it disabled (the control: the same in-place change
    with no state dict held). Asserts the control against FSDP2 here; the comparison with
    the manager enabled is the test's."""
    from torchtitan.components.checkpoint import CheckpointManager

    dims, cfg = tw._setup(world, {"data_parallel_shard_degree": world}, steps=2, max_norm=0.25, local_bs=2,
                          accum=1, loss="ce", ac=False, fuse_qkv=False)
    got = {}
    for impl, enabled in (("fsdp2", True), ("ours", False), ("ours", True)):
        c = CheckpointManager.Config(enable=enabled, folder=os.path.join(folder, "inplace", impl, str(enabled)),
                                     keep_latest_k=0)
        t = tw._titan_trainer(cfg, dims, impl, checkpoint=c)
        before = full_params(t, impl)
        with torch.no_grad():
            for p in t.model_parts[0].parameters():
                p.mul_(0.5)
        scaled = full_params(t, impl)
        assert _max_abs(scaled, {k: v * 0.5 for k, v in before.items()}) == 0.0, f"{impl}: mul_ did not apply"
        row = tw._train(t, 1)[0]
        got[(impl, enabled)] = (row, full_params(t, impl))
        t.checkpointer.close()
    ref_row, ref_params = got[("fsdp2", True)]
    worst: Dict[str, float] = {}
    control_row, control_params = got[("ours", False)]
    tw._compare_rows(control_row, ref_row, 1, tol, worst, "ours without a manager vs FSDP2 (control)")
    e = _max_rel(control_params, ref_params, "control")
    assert e <= tol, f"ours without a manager vs FSDP2 (control): parameters rel err {e:.2e}"
    row, params = got[("ours", True)]
    return {"fsdp2_loss": ref_row["loss"], "ours_loss": row["loss"], "ours_loss_without_manager": control_row["loss"],
            "loss_rel": tw._rel(row["loss"], ref_row["loss"]), "param_rel": _max_rel(params, ref_params, "bug")}
