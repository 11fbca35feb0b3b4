"""Gloo process groups with one worker thread in the test ranks.

torch's ProcessGroupGloo runs collectives on two worker threads per group (the count
init_process_group and new_group always use). After each collective, the thread that ran
it stores the op's name in the group's status (`pgStatus_->lastCompletedWorkName`,
ProcessGroupGloo::runLoop) outside the group's lock. When two collectives finish at the
same moment, one on each thread, both threads free the string's old buffer: a double free
that corrupts the heap. The process then dies later, anywhere ("malloc(): unaligned tcache
chunk detected", SIGSEGV in a later Gloo collective). AddressSanitizer caught it in this
suite: "attempting double-free" in ProcessGroupGloo::runLoop on one worker thread of a
buffer the other worker thread had freed. Two collectives finishing together is what
FSDP2's asynchronous all-gather and reduce-scatter do on every step; with one thread per
group no two runLoops exist.

The name `ProcessGroupGloo` in torch.distributed.distributed_c10d is what its group
construction calls and what its isinstance checks test, so a subclass that asks for one
thread replaces it there. Collectives on one group then run in issue order, which every
rank shares. The launcher (harness/launcher.py) applies it in every rank before
init_process_group; processes a test starts itself (torchrun, benchmark scripts) keep
torch's two threads."""
from __future__ import annotations

import os

import torch.distributed as dist


def _one_thread_class():
    base = dist.ProcessGroupGloo

    class OneThreadProcessGroupGloo(base):
        def __init__(self, store, rank, size, timeout=None):
            if isinstance(timeout, base._Options):  # an explicit Options: as given
                super().__init__(store, rank, size, timeout)
                return
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            options._devices = ([base.create_device(interface=i) for i in interfaces] if interfaces
                                else [base.create_default_device()])
            options._threads = 1
            super().__init__(store, rank, size, options)

    OneThreadProcessGroupGloo.__name__ = base.__name__
    OneThreadProcessGroupGloo.__qualname__ = base.__qualname__
    return OneThreadProcessGroupGloo


def use_one_worker_thread() -> None:
    """From now on, Gloo groups this process creates run one worker thread. Idempotent."""
    if not dist.is_available() or not dist.is_gloo_available():
        return
    c10d = dist.distributed_c10d
    if getattr(c10d.ProcessGroupGloo, "_mfsdp_one_thread", False):
        return
    cls = _one_thread_class()
    cls._mfsdp_one_thread = True
    c10d.ProcessGroupGloo = cls
