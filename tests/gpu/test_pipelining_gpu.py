"""torch's pipelining over stages sharded by ours with CUDA tensors on the GPU suite's
backend (harness/pp_workers.py, as tests/distributed/test_pipelining.py on Gloo CPU):
(pp 2, dp 2) at world 4; every schedule against FSDP2 and one plain process, the gradient
reduced once per step, runtime schedules' units gathered ahead."""
import pytest

from harness import gpu_launch, gpu_world, run_distributed
from harness import pp_workers as w
from harness.pp_workers import check_parity, check_reduced_once_per_step, check_unsharded_ahead

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_world(4)]  # the mesh is (pp 2, dp 2)
WORLD = gpu_world()
GPU = gpu_launch()
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"]
SPLIT_BACKWARD = ["zbv", "interleaved_zb", "dualpipev"]


def _reports(runs):
    per_rank = run_distributed(w.pp_parity, WORLD, runs, 3, 1e-5, **GPU, timeout=300)
    return {run["schedule"]: [r[run["schedule"]] for r in per_rank] for run in runs}


@pytest.mark.dtensor_collectives
def test_pipelining_schedules_match_fsdp2_gpu():
    reports = _reports([{"schedule": s} for s in SCHEDULES])
    for schedule, rs in reports.items():
        check_parity(rs, schedule)
        check_reduced_once_per_step(rs, schedule)
        if schedule in ("interleaved_1f1b", "looped_bfs"):
            check_unsharded_ahead(rs, schedule)


@pytest.mark.dtensor_collectives
def test_split_backward_schedules_gpu():
    reports = _reports([{"schedule": s, "reshard_after_forward": False} for s in SPLIT_BACKWARD])
    for schedule, rs in reports.items():
        check_parity(rs, schedule)
        check_reduced_once_per_step(rs, schedule)
