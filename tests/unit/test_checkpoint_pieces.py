"""checkpoint_pieces.boxes: a rank's contiguous range of a parameter's row-major elements
as boxes of the full tensor, which a load reads from the stored chunks directly."""
import math
import random

import torch

from megatron_fsdp_ext.checkpoint.pieces import PieceTarget, boxes


def _elements(shape, box):
    offsets, sizes = box
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
    return torch.arange(math.prod(shape)).reshape(shape)[index].reshape(-1)


def test_boxes_cover_the_range_in_order_and_nothing_else():
    rng = random.Random(0)
    shapes = [(), (7,), (3, 5), (4, 1, 6), (2, 3, 4, 5), (5, 0, 3), (1, 1)]
    for shape in shapes:
        total = math.prod(shape)
        for _ in range(40):
            start = rng.randrange(total + 1) if total else 0
            count = rng.randrange(total - start + 1) if total else 0
            found = boxes(shape, start, count)
            got = torch.cat([_elements(shape, b) for b in found]) if found else torch.empty(0, dtype=torch.long)
            assert torch.equal(got, torch.arange(start, start + count)), (shape, start, count, found)
            assert len(found) <= 2 * max(1, len(shape)), (shape, start, count, found)  # a few boxes, not rows


def test_piece_target_views_write_the_piece_in_order():
    shape, start, count = (4, 5, 3), 7, 41
    piece = torch.zeros(count, dtype=torch.long)
    target = PieceTarget(shape, piece, start)
    full = torch.arange(math.prod(shape)).reshape(shape)
    for chunk in target.chunks():
        index = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
        target.box(chunk.offsets).copy_(full[index])
    assert torch.equal(piece, torch.arange(start, start + count))
