"""checkpoint_reader refuses DCP metadata whose chunks do not cover each tensor exactly
once: DCP leaves a part of a target that no chunk covers as it was, so two chunks at one
place and a gap elsewhere (one flipped offset) would load old values silently. The
fuzzer found such a .metadata (benchmarks/RESULTS.md, checkpoint fuzzing)."""
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.filesystem import _StorageInfo

from megatron_fsdp_ext.checkpoint.files import CheckpointError
from megatron_fsdp_ext.checkpoint.reader import read_metadata_file


def _write(tmp_path, chunks, size=(16, 4)):
    entry = TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size),
                                  chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n))
                                          for o, n in chunks])
    storage = {MetadataIndex("w", torch.Size(o)): _StorageInfo("__0_0.distcp", 0, 1) for o, _ in chunks}
    path = tmp_path / ".metadata"
    with open(path, "wb") as f:
        pickle.dump(Metadata(state_dict_metadata={"w": entry}, storage_data=storage), f)
    return str(path)


def test_exact_tilings_load(tmp_path):
    read_metadata_file(_write(tmp_path, [((0, 0), (8, 4)), ((8, 0), (8, 4))]))
    read_metadata_file(_write(tmp_path, [((0, 0), (16, 2)), ((0, 2), (16, 2))]))  # columns
    read_metadata_file(_write(tmp_path, [((0, 0), (8, 2)), ((0, 2), (8, 2)), ((8, 0), (8, 4)), ((3, 1), (0, 2))]))


def test_two_chunks_at_one_place_and_a_gap_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"overlapping chunks at \(0, 0\) and \(0, 0\)"):
        read_metadata_file(_write(tmp_path, [((0, 0), (8, 4)), ((0, 0), (8, 4))]))


def test_a_missing_chunk_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="chunks of 32 elements in all: they do not cover it exactly once"):
        read_metadata_file(_write(tmp_path, [((0, 0), (8, 4))]))


def test_many_chunks(tmp_path):
    rows = [((r, 0), (1, 4)) for r in range(16)]
    read_metadata_file(_write(tmp_path, rows))
    rows[9] = ((8, 0), (1, 4))
    rows.append(((9, 0), (0, 4)))
    with pytest.raises(CheckpointError, match="do not cover it exactly once"):
        read_metadata_file(_write(tmp_path, rows))
