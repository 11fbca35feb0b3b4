"""The peak-memory reader used on benchmark snapshots: a synthetic trace with a known peak."""
import pickle

import pytest

from megatron_fsdp_ext.tools.memory import large_events_to, live_at_peak, main


def frame(name, line):
    return {"filename": f"/src/{name}.py", "line": line, "name": name}


def ev(action, addr, size, origin=None):
    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"}]
    if origin:
        frames.append(frame(*origin))
    return {"action": action, "addr": addr, "size": size, "frames": frames}


SNAPSHOT = {"segments": [], "device_traces": [[
    ev("alloc", 1, 100, ("model", 10)),
    ev("alloc", 2, 50, ("grads", 20)),
    ev("free_requested", 2, 50),
    ev("free_completed", 2, 50),
    ev("alloc", 3, 70, ("grads", 20)),
    ev("alloc", 4, 30, ("grads", 20)),   # peak here: 100 + 70 + 30
    ev("free_requested", 3, 70),
    ev("alloc", 5, 60, ("model", 11)),   # 190 < 200
]]}


def test_peak_and_live_blocks_by_origin():
    peak, at, rows = live_at_peak(SNAPSHOT)
    assert peak == 200 and at == 5
    # Grouped by the first frame outside torch, largest first, ties by origin.
    assert rows == [("grads.py:20 grads", 2, 100), ("model.py:10 model", 1, 100)]


def test_large_events_up_to_the_peak_name_their_allocation():
    # The trace with every size in MiB: events of at least 50 MiB up to the peak (event
    # 5); a free is named by where its block was allocated.
    mib = {"segments": [], "device_traces": [[dict(e, size=e["size"] << 20) for e in SNAPSHOT["device_traces"][0]]]}
    assert large_events_to(mib, 5, min_bytes=50 << 20) == [
        [0, "alloc", 100.0, "model.py:10 model"],
        [1, "alloc", 50.0, "grads.py:20 grads"],
        [2, "free_requested", 50.0, "grads.py:20 grads"],
        [4, "alloc", 70.0, "grads.py:20 grads"],
    ]
    assert large_events_to(mib, 5, min_bytes=50 << 20, last=1) == [[4, "alloc", 70.0, "grads.py:20 grads"]]


def test_missing_device_is_an_error():
    with pytest.raises(ValueError, match="1 devices, asked for device 3"):
        live_at_peak(SNAPSHOT, device=3)


def test_cli_prints_peak(tmp_path, capsys, monkeypatch):
    # The same trace with every size in units of 1/8 GiB: peak 200/8 = 25 GiB at event 5,
    # the grads rows 100/8 = 12.5 GiB.
    scaled = {"segments": [], "device_traces": [[dict(e, size=e["size"] * 2**27) for e in SNAPSHOT["device_traces"][0]]]}
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(scaled))
    monkeypatch.setattr("sys.argv", ["memory", str(path)])
    main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: peak 25.000 GiB of traced allocations at event 5"
    assert lines[1].split() == ["12.500", "GiB", "2x", "grads.py:20", "grads"]
    assert lines[2].split() == ["12.500", "GiB", "1x", "model.py:10", "model"]
