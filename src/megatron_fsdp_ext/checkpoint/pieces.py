"""Reading a checkpoint straight into each rank's pieces of the shards.

A checkpoint stores every parameter (and the optimizer state shaped like it) in its full
shape, in whatever chunks wrote it (FSDP2's rows). A unit's rank holds a contiguous range
of each parameter's row-major elements: that range is a few boxes of the full tensor
(a partial first row, whole rows, a partial last row, recursively in more dimensions),
each contiguous in memory. Reading those boxes from the stored chunks gives the rank its
piece with no data exchange between ranks, as FSDP2's load reads its DTensor shards.

The reads are planned here, on each rank alone (DCP's public read-item helpers and our
SafeFileSystemReader), so they need no collective either; the load agrees on how they
went afterwards. Values stored as bytes (hyper-parameters, our metadata) are read the
same way.
"""
from __future__ import annotations

import io
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .reader import SafeFileSystemReader, load_weights_only
from ..core.dtensor_face import is_dtensor, local_numel

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes) in the full tensor


def boxes(shape: Sequence[int], start: int, count: int) -> List[Box]:
    """The elements [start, start + count) of a row-major tensor of `shape` as boxes, in
    order; each box's elements are contiguous in that order."""
    shape = tuple(int(d) for d in shape)
    if count <= 0:
        return []
    if not shape:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (count,))]
    row_numel = math.prod(shape[1:])
    rest = shape[1:]
    end = start + count
    out: List[Box] = []
    row, within = divmod(start, row_numel)
    if within:  # a partial first row
        take = min(count, row_numel - within)
        out += [((row,) + o, (1,) + s) for o, s in boxes(rest, within, take)]
        start += take
    whole = (end - start) // row_numel
    if whole:
        out.append(((start // row_numel,) + (0,) * len(rest), (whole,) + rest))
        start += whole * row_numel
    if start < end:  # a partial last row
        out += [((start // row_numel,) + o, (1,) + s) for o, s in boxes(rest, 0, end - start)]
    return out


class PieceTarget:
    """A read target: `piece` (1-D) receives elements [start, start + piece.numel()) of
    an entry of `full_shape`, box by box."""

    def __init__(self, full_shape: Sequence[int], piece: torch.Tensor, start: int):
        self.full_shape = torch.Size(full_shape)
        self.piece = piece
        self._views: Dict[Tuple[int, ...], torch.Tensor] = {}
        at = 0
        for offsets, sizes in boxes(self.full_shape, start, piece.numel()):
            n = math.prod(sizes)
            self._views[offsets] = piece[at:at + n].view(sizes)
            at += n

    def chunks(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self._views.items()]

    def box(self, offsets) -> torch.Tensor:
        return self._views[tuple(offsets)]


def piece_targets(flat: Dict[str, Any], made: Dict[int, tuple]) -> Optional[Dict[str, Any]]:
    """`flat` (a load's flattened targets, made under state_dict.unread_values(), which
    recorded every sharded value in `made`) with each recorded value replaced by a
    PieceTarget over a fresh buffer shaped like the rank's piece; None when any sharded
    value cannot be read so: a tensor-parallel parameter, or a value a module's hook put
    in place of ours (its key or layout is then the hook's, not the unit's)."""
    from ..core.state_dict import tp_spec_of

    out: Dict[str, Any] = {}
    for key, value in flat.items():
        entry = made.get(id(value))
        if entry is None:
            if is_dtensor(value):
                return None
            out[key] = value
            continue
        _, state, index = entry
        spec = state.unit.param_spec(index)
        if tp_spec_of(state, index) is not None or spec.slice.numel != local_numel(state.unit.sharded_param(index)):
            return None
        local = value.to_local() if is_dtensor(value) else value
        piece = torch.empty(spec.slice.numel, dtype=local.dtype, device=local.device)
        out[key] = PieceTarget(spec.shape, piece, spec.slice.param_offset)
    return out


class _Destinations:
    """What SafeFileSystemReader.read_data asks of a planner, for reads planned here:
    where each read item's data goes. Every item has a place of its own: the reader's
    threads call it at once. The targets are fresh tensors that nothing reads unless the
    whole load is agreed on, so the reader may read an entry's bytes straight into one
    before it has checked them."""

    reads_concurrently = True
    fills_fresh_tensors = True

    def __init__(self, targets: Dict[str, Any], storage_data: dict):
        self.targets = targets
        self.storage_data = storage_data
        self.loaded: Dict[str, Any] = {}

    def resolve_tensor(self, item: ReadItem) -> torch.Tensor:
        target = self.targets[item.dest_index.fqn]
        dest = target.box(item.dest_index.offset) if isinstance(target, PieceTarget) else target
        for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, item: ReadItem, value: io.BytesIO) -> None:
        fqn = item.dest_index.fqn
        info = self.storage_data.get(item.storage_index)
        where = f"{getattr(info, 'relative_path', '?')} (entry '{fqn}', where .metadata places it)"
        self.loaded[fqn] = load_weights_only(value, where)


def read_locally(directory: str, metadata, flat: Dict[str, Any], verification, threads: int = 1) -> Dict[str, Any]:
    """Read every entry of `flat` on this rank alone (no collective): tensors and
    PieceTargets are filled in place (they must be fresh: an entry whose bytes fail their
    checks may have been read into its target already); entries stored as bytes are
    returned, by key. The
    keys and shapes must have been checked against `metadata` (every key present, tensors
    where it holds tensors). verification, threads: SafeFileSystemReader's (an entry
    whose bytes the verification refused is left unread, and recorded there)."""
    reader = SafeFileSystemReader(directory, metadata=metadata, verification=verification, threads=threads)
    reader.set_up_storage_reader(metadata, False)
    entries = metadata.state_dict_metadata
    items: List[ReadItem] = []
    for fqn, target in flat.items():
        stored = entries[fqn]
        if isinstance(stored, BytesStorageMetadata):
            index = MetadataIndex(fqn)
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            continue
        if isinstance(target, PieceTarget):
            chunks = target.chunks()
        else:
            chunks = [ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.shape)]
        items += create_read_items_for_chunk_list(fqn, stored, chunks)
    destinations = _Destinations(flat, metadata.storage_data)
    reader.read_data(LoadPlan(items), destinations).wait()
    return destinations.loaded


def set_at(tree, path: Sequence, value) -> None:
    """tree[path[0]][path[1]]... = value (dict keys and list indices)."""
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value
