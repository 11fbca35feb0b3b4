"""The manifest's records of data files (checkpoint_files): the byte ranges of the entries
DCP stored, and of every gap, tile each file exactly; each range's sha256 is computed in
one pass; a manifest whose ranges do not tile a file is refused naming it."""
import hashlib
import json
import os

import pytest

from megatron_fsdp_ext.checkpoint.files import (MANIFEST_FORMAT, MANIFEST_NAME, CheckpointError, data_file_records,
                                                digest_ranges, entry_ranges, read_manifest)


def test_entries_that_tile_the_file_are_its_ranges():
    assert entry_ranges("f", 10, [(4, 6), (0, 4)]) == [(0, 4), (4, 6)]
    assert entry_ranges("f", 10, [(0, 4), (0, 4), (4, 6)]) == [(0, 4), (4, 6)]  # a range two entries share
    assert entry_ranges("f", 0, []) == []


def test_gaps_get_ranges_of_their_own():
    assert entry_ranges("f", 20, [(3, 4), (10, 2)]) == [(0, 3), (3, 4), (7, 3), (10, 2), (12, 8)]
    assert entry_ranges("f", 5, []) == [(0, 5)]


def test_overlapping_entries_or_entries_past_the_end_are_refused():
    with pytest.raises(ValueError, match="'f': the entry at bytes 3-8 overlaps the one before it, which ends at byte 4"):
        entry_ranges("f", 10, [(0, 4), (3, 5)])
    with pytest.raises(ValueError, match="'f' has 10 bytes, but an entry ends at byte 12"):
        entry_ranges("f", 10, [(0, 4), (4, 8)])


def test_each_range_is_hashed_and_the_records_tile_the_file(tmp_path, monkeypatch):
    import megatron_fsdp_ext.checkpoint.files as files

    monkeypatch.setattr(files, "_HASH_BLOCK", 7)  # ranges longer than one read
    data = os.urandom(100)
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(data)
    records = data_file_records(str(tmp_path), {"a": [(0, 40), (40, 60)], "b": [(10, 30), (50, 20)]}, threads=2)
    expect = {"a": [(0, 40), (40, 60)], "b": [(0, 10), (10, 30), (40, 10), (50, 20), (70, 30)]}
    for name, ranges in expect.items():
        assert records[name] == {"size": 100, "entries": [[o, n, hashlib.sha256(data[o:o + n]).hexdigest()]
                                                          for o, n in ranges]}, name
    with pytest.raises(ValueError, match="ends before byte 120"):
        digest_ranges(str(tmp_path / "a"), [(0, 100), (100, 20)])


def _manifest_with(tmp_path, record):
    manifest = {"format": MANIFEST_FORMAT, "version": 2, "world_size": 1, "files": {"__0_0.distcp": record}}
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(manifest))
    return read_manifest("ckpt", str(tmp_path))


def test_a_manifest_whose_ranges_do_not_tile_the_file_is_refused(tmp_path):
    digest = hashlib.sha256(b"").hexdigest()
    assert _manifest_with(tmp_path, {"size": 10, "entries": [[0, 4, digest], [4, 6, digest]]})
    cases = {
        "one starts at byte 5, the one before ends at 4": [[0, 4, digest], [5, 5, digest]],  # a gap
        "one starts at byte 3, the one before ends at 4": [[0, 4, digest], [3, 7, digest]],  # an overlap
        "end at byte 8, but gives a size of 10 bytes": [[0, 4, digest], [4, 4, digest]],  # short of the end
        "not [offset, length, sha256]": [[0, 10, "not a digest"]],
    }
    for problem, entries in cases.items():
        with pytest.raises(CheckpointError, match=r"the record of '__0_0\.distcp'.*" + problem.replace("[", r"\[")):
            _manifest_with(tmp_path, {"size": 10, "entries": entries})
    with pytest.raises(CheckpointError, match="the record of '__0_0.distcp' gives no size"):
        _manifest_with(tmp_path, {"entries": []})


def test_metadata_pickles_are_walked_for_lengths_before_unpickling(tmp_path):
    """.metadata is walked opcode by opcode before the C unpickler sees it: a counted
    argument claiming more bytes than the file holds (which that unpickler would allocate
    first), an opcode DCP's metadata never uses, an unknown opcode or a missing STOP is
    refused; real pickles pass."""
    import pickle

    from megatron_fsdp_ext.checkpoint.reader import check_pickle_lengths, read_metadata_file

    for value in ({"a": [1, 2.5, "x" * 300, b"y" * 70000, (None, True)]}, list(range(1000))):
        for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
            check_pickle_lengths(pickle.dumps(value, protocol=protocol))
    huge = b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b"abc."  # BINBYTES8 of a TiB
    cases = {huge: "claims 1099511627776 bytes; 4 follow",
             b"\x80\x04K\x01Q.": "BINPERSID",  # a persistent id
             b"\x80\x04\xff.": "unknown pickle opcode 0xff",
             pickle.dumps([1, 2, 3])[:-1]: "before its STOP"}
    for data, problem in cases.items():
        with pytest.raises(ValueError, match=problem):
            check_pickle_lengths(data)
    (tmp_path / ".metadata").write_bytes(huge)
    with pytest.raises(CheckpointError, match="not a readable DCP metadata file.*claims 1099511627776 bytes"):
        read_metadata_file(str(tmp_path / ".metadata"))
