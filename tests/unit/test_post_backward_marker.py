"""The post-backward marker (csrc/post_backward.cpp) and the forward-input cast
(core/hook_support.py): the two pieces every unit's forward runs, checked against plain
autograd and pytree."""
import pytest
import torch
from torch.utils._pytree import tree_map

from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core import hooks
from megatron_fsdp_ext.core.hook_support import cast_call_inputs, is_flat_call


@pytest.fixture
def reported():
    keys = []
    _C.set_post_backward_callback(keys.append)
    yield keys
    _C.set_post_backward_callback(hooks._post_backward_of_key)


def test_marker_passes_gradients_through_and_reports_once_its_outputs_gradients_are_complete(reported):
    torch.manual_seed(0)
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    x, y = a * 2, b + 1
    mx, my = _C.mark_post_backward(7, [x, y])
    assert mx.shape == x.shape and torch.equal(mx, x) and torch.equal(my, y)
    assert mx.grad_fn is not None and mx.grad_fn is my.grad_fn
    assert mx.grad_fn.name() == "mfsdp::PostBackwardMarker"
    # A hook on the marked output fires once all of its consumers' backward is done: the
    # report comes after it, never earlier (e.g. in forward) and once.
    mx.register_hook(lambda g: reported.append("gradient of the marked input"))
    assert reported == []
    (mx * my).sum().backward()
    assert reported == ["gradient of the marked input", 7]
    # The same gradients as without the marker.
    a_ref, b_ref = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((a_ref * 2) * (b_ref + 1)).sum().backward()
    assert torch.equal(a.grad, a_ref.grad) and torch.equal(b.grad, b_ref.grad)


def test_marker_passes_an_input_without_gradient_through(reported):
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    mx, my = _C.mark_post_backward(3, [a * 1, b * 1])
    (mx * 2).sum().backward()  # my gets no gradient: it reaches b as none
    assert reported == [3]
    assert torch.equal(a.grad, torch.full((3,), 2.0)) and b.grad is None


def test_marker_reports_once_per_backward_of_each_call(reported):
    w = torch.randn(2, requires_grad=True)
    outs = [_C.mark_post_backward(k, [w * k])[0] for k in (1, 2)]
    sum(o.sum() for o in outs).backward()
    assert sorted(reported) == [1, 2]


def test_marker_outside_grad_mode_returns_the_inputs(reported):
    a = torch.randn(2, requires_grad=True)
    with torch.no_grad():
        (out,) = _C.mark_post_backward(5, [a])
    assert out is a  # no node, no view: the inputs as they are
    plain = torch.randn(2)
    (out2,) = _C.mark_post_backward(5, [plain])  # nothing needs a gradient
    assert out2 is plain
    assert reported == []


def test_an_in_place_write_to_a_marked_input_fails_loudly(reported):
    # Autograd cannot rebuild the input's history through the marker: the write must
    # raise (as for any custom Function's output that is its input), never train silently.
    x = torch.randn(3, requires_grad=True) * 1
    (mx,) = _C.mark_post_backward(1, [x])
    with pytest.raises(RuntimeError, match="is a view and is being modified inplace.*created inside a custom Function"):
        mx.mul_(2)


def test_marker_refuses_forward_mode_gradients(reported):
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        primal = torch.randn(3, requires_grad=True) * 1
        dual = fwAD.make_dual(primal, torch.ones(3))
        with pytest.raises(RuntimeError, match="forward-mode"):
            _C.mark_post_backward(1, [dual])


def test_marker_refuses_torch_func_transforms(reported):
    # Under torch.func the unit's reduction would run on gradients that never reach .grad.
    def f(x):
        (mx,) = _C.mark_post_backward(1, [x * 1])
        return (mx * mx).sum()

    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(f)(torch.randn(3))
    assert reported == []


def _reference_cast(args, kwargs, dtype):
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    (args, kwargs))


@pytest.mark.parametrize("call", ["flat", "kwargs", "nested"])
def test_cast_call_inputs_matches_the_pytree_cast(call):
    f32, ids = torch.randn(2, 3), torch.arange(4)
    f16 = torch.randn(2, dtype=torch.float16)
    if call == "flat":
        args, kwargs = (f32, ids, 3, 0.5, None, "s", f16), {}
    elif call == "kwargs":
        args, kwargs = (f32,), {"mask": f16, "ids": ids, "scale": 2.0}
    else:
        args, kwargs = ([f32, ids], {"h": (f16,)}), {}
    # The flat call takes the fast path; the others the pytree walk it must agree with.
    assert is_flat_call(args, kwargs) == (call == "flat")
    got_args, got_kwargs = cast_call_inputs(args, kwargs, torch.bfloat16)
    want_args, want_kwargs = _reference_cast(args, kwargs, torch.bfloat16)
    got, want = (got_args, got_kwargs), (want_args, want_kwargs)
    flat_got, flat_want = torch.utils._pytree.tree_flatten(got), torch.utils._pytree.tree_flatten(want)
    assert flat_got[1] == flat_want[1], "structure differs"
    for g, w in zip(flat_got[0], flat_want[0]):
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and torch.equal(g, w)
        else:
            assert g == w
    assert isinstance(got_args, tuple)
    if call == "flat":
        assert got_args[1] is ids  # a non-floating tensor is passed as it is
