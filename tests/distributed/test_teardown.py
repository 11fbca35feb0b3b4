"""Tearing down: a process group whose last reference is held by one of our objects is
destroyed without deadlocking against Gloo's worker threads.

A Gloo worker that just finished a collective issued from Python drops that work's
tensors, which needs the GIL; the group's destructor waits for the worker. If our object
(Communicator, Unit, CommContext) held the last reference and was freed with the GIL held,
the two waited on each other forever (seen in CI as a benchmark that hung after writing
its results). Each loop below hung within a few iterations before the fix; the launcher's
timeout turns a hang into a failure."""
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext import _C
from harness import run_distributed

ITERS = 40


def _python_collectives(group):
    # Work issued from Python: its tensors carry Python objects that the Gloo worker
    # releases after the caller has already returned.
    t = torch.ones(256)
    dist.all_reduce(t, group=group)
    dist.barrier(group=group)
    assert t[0].item() == dist.get_world_size(group)


def _new_group():
    return dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo")


def _teardown_loops(rank, world):
    for _ in range(ITERS):  # a Communicator holds the last reference
        group = _new_group()
        comm = _C.Communicator(group)
        _python_collectives(group)
        dist.destroy_process_group(group)
        del group
        del comm

    for _ in range(ITERS):  # a Unit holds the last reference (and a context)
        group = _new_group()
        unit = _C.Unit([torch.randn(8, 4)], ["w"], group)
        unit.set_context(_C.CommContext(torch.device("cpu")))
        _python_collectives(group)
        dist.destroy_process_group(group)
        del group
        del unit

    for _ in range(ITERS):  # replacing a unit's all-gather group drops the old one
        group, other = _new_group(), _new_group()
        unit = _C.Unit([torch.randn(8, 4)], ["w"], dist.group.WORLD)
        unit.set_all_gather_group(group)
        _python_collectives(group)
        dist.destroy_process_group(group)
        del group
        unit.set_all_gather_group(other)
        dist.destroy_process_group(other)
        del other, unit

    for _ in range(ITERS // 4):  # a sharded model that trained on its own group
        group = _new_group()
        torch.manual_seed(0)
        model = mfsdp.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), process_group=group)
        model(torch.randn(4, 8)).sum().backward()
        _python_collectives(group)
        dist.destroy_process_group(group)
        del group
        del model
    return True


def test_group_destroyed_through_our_objects_does_not_hang():
    assert run_distributed(_teardown_loops, 2, timeout=120) == [True, True]


_EXIT_SCRIPT = r"""
import atexit, os, sys, weakref
import torch, torch.distributed as dist, torch.nn as nn

collected = {}

def check():  # registered before the package's own handler, so it runs after it
    alive = collected["model"]() is not None
    print("sharded model alive at exit:", alive, flush=True)
    sys.stdout.flush()
    os._exit(3 if alive else 0)

atexit.register(check)
import megatron_fsdp_ext as mfsdp

dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d")
group = dist.new_group([0], backend="gloo")
model = mfsdp.fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), process_group=group)
model(torch.randn(2, 4)).sum().backward()
model.cycle = [model]  # a cycle only the collector frees, as a real training script's
collected["model"] = weakref.ref(model)
del model
dist.destroy_process_group()
"""


def test_sharded_modules_are_collected_before_the_interpreter_shuts_down(tmp_path):
    """The package collects reference cycles at exit (atexit), so a sharded module's
    process groups are freed while the interpreter is whole: this script's own exit
    handler, which runs after the package's, finds the cycle of a sharded model gone."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "exit_collect.py"
    script.write_text(_EXIT_SCRIPT % port)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "alive at exit: False" in done.stdout, (done.returncode, done.stdout,
                                                                           done.stderr[-2000:])
