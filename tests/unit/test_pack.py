"""Packing/cast kernels against plain torch (CPU here; the GPU suite runs them on CUDA)."""
import pytest
import torch

from megatron_fsdp_ext import _C

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_pack(flat, tensors, offsets, accumulate, scale=1.0):
    out = flat.clone() if accumulate else torch.zeros_like(flat)
    for t, off in zip(tensors, offsets):
        if t is None:
            continue
        seg = out[off: off + t.numel()]
        scaled = t.reshape(-1).float() * scale
        seg.copy_((seg.float() + scaled) if accumulate else scaled)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25, 1 / 3])
def test_pack_into_flat_matches_reference(device, src_dtype, dst_dtype, accumulate, scale):
    g = torch.Generator().manual_seed(0)
    # Many tensors, some empty, some missing, some larger than one CUDA chunk (16384),
    # and more tensors than one launch holds (48) to exercise launch splitting.
    sizes = [0, 1, 5, 16, 40000, 3, 17000] + [7] * 60 + [300000]
    tensors, offsets, cursor = [], [], 0
    for i, n in enumerate(sizes):
        cursor = (cursor + 15) // 16 * 16
        offsets.append(cursor)
        t = torch.randn(n, generator=g).to(src_dtype).to(device)
        tensors.append(None if i % 11 == 4 else t.view(-1, 1) if n else t)
        cursor += n
    flat = torch.randn(cursor + 9, generator=g).to(dst_dtype).to(device)
    expected = reference_pack(flat, tensors, offsets, accumulate, scale)
    _C.pack_into_flat(flat, tensors, offsets, accumulate, True, scale)
    if not accumulate:
        # One product in fp32, rounded once into the buffer's dtype: exactly the reference.
        assert torch.equal(flat, expected)
    else:
        tol = dict(rtol=1e-6, atol=1e-6) if dst_dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(flat.float(), expected.float(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_fill", [False, True])
def test_pack_misaligned_pieces_and_one_launch_of_many_chunks(device, src_dtype, zero_fill):
    # The CUDA kernel moves 16-byte vectors only where source and destination are aligned
    # for them: sources that are views at odd elements, and odd destination offsets, take
    # the scalar path; a tensor of more chunks than a thread-block wave (5M elements, 306
    # chunks) and a partial last vector run in one launch. Without zero_fill, what no
    # tensor covers keeps its values.
    g = torch.Generator().manual_seed(1)
    base = torch.randn(5_000_003, generator=g).to(src_dtype).to(device)
    tensors = [base[1:4_900_002], base[3:40_003], base[:8], base[8:4_100_019], None, base[5:6]]
    offsets, cursor = [], 0
    for t, gap in zip(tensors, [0, 3, 8, 1, 0, 2]):
        cursor += gap
        offsets.append(cursor)
        cursor += t.numel() if t is not None else 1000
    flat = torch.randn(cursor + 5, generator=g).to(device)
    expected = torch.zeros_like(flat) if zero_fill else flat.clone()
    for t, off in zip(tensors, offsets):
        if t is not None:
            expected[off: off + t.numel()] = t.float()
    _C.pack_into_flat(flat, tensors, offsets, False, zero_fill)
    assert torch.equal(flat, expected)
    # Accumulate, scaled: covered ranges add a third of each value, the rest stays.
    _C.pack_into_flat(flat, tensors, offsets, True, zero_fill, 1 / 3)
    for t, off in zip(tensors, offsets):
        if t is not None:
            expected[off: off + t.numel()] += t.float() * (1 / 3)
    torch.testing.assert_close(flat, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_pack_scales_before_it_narrows(device, accumulate):
    # fp32 gradients packed into an fp16 buffer with a scale: 1e5 and 7e4 do not fit fp16
    # (max 65504), their thirds do. Narrowing first would give inf.
    grads = torch.tensor([1e5, 7e4, -9e4], device=device)
    flat = torch.zeros(3, dtype=torch.float16, device=device)
    _C.pack_into_flat(flat, [grads], [0], accumulate, False, 1 / 3)
    assert torch.equal(flat, (grads * (1 / 3)).half())


def test_pack_rejects_out_of_range():
    flat = torch.zeros(10)
    with pytest.raises(RuntimeError, match="exceeds the flat buffer"):
        _C.pack_into_flat(flat, [torch.ones(5)], [8])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accumulate", [False, True])
def test_cast_scale_into(device, src_dtype, accumulate):
    src = torch.randn(1000).to(src_dtype).to(device)
    dst = torch.randn(1000, device=device)
    expected = (dst if accumulate else 0) + src.float() * 0.25
    _C.cast_scale_into(dst, src, 0.25, accumulate)
    torch.testing.assert_close(dst, expected, rtol=1e-6, atol=1e-6)


def test_cast_scale_in_place():
    t = torch.arange(8.0)
    _C.cast_scale_into(t, t, 0.5, False)
    assert t.tolist() == [x * 0.5 for x in range(8)]


@pytest.mark.parametrize("device", DEVICES)
def test_cast_scale_in_place_by_one_is_no_work(device):
    # The usual reduction: the pack applied the scale, the shard was reduced into the
    # gradient itself; nothing is left to do, and a kernel would be a wasted pass.
    t = torch.arange(8.0, device=device)
    _C.cast_scale_into(t, t, 1.0, False)
    assert t.tolist() == [float(x) for x in range(8)]
    _C.cast_scale_into(t, t, 0.5, False)  # a factor changed after the pack: still applied
    assert t.tolist() == [x * 0.5 for x in range(8)]
    with pytest.raises(RuntimeError, match="cannot accumulate a buffer into itself"):
        _C.cast_scale_into(t, t, 1.0, True)
