"""The CPU optimizers (megatron_fsdp_ext.optim) against torch.optim on the CPU: same
parameters and state after several steps of the same gradients, for every option that
changes the arithmetic; state dicts interchangeable; the bf16 copy-out is the rounding
of the updated weights; bad input raises naming the problem."""
import pytest
import torch

from megatron_fsdp_ext import _C, optim


def _params(seed=0, shapes=((257, 33), (1000,), (3,), (0,), (70001,))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def _run(make, params, steps=5, seed=1, grad_scale=None):
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = make(ps)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
            if grad_scale is not None and not isinstance(opt, optim.cpu._CPUOptimizer):
                p.grad.mul_(grad_scale)
        if grad_scale is not None and isinstance(opt, optim.cpu._CPUOptimizer):
            opt.step(grad_scale=grad_scale)
        else:
            opt.step()
    return ps, opt


ADAM_CASES = [
    dict(),
    dict(lr=3e-2, weight_decay=0.1),
    dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
    dict(lr=1e-2, maximize=True, weight_decay=0.05),
]


@pytest.mark.parametrize("kw", ADAM_CASES)
@pytest.mark.parametrize("ours, theirs", [(optim.CPUAdamW, torch.optim.AdamW), (optim.CPUAdam, torch.optim.Adam)])
def test_adam_matches_torch(kw, ours, theirs):
    params = _params()
    a, oa = _run(lambda ps: ours(ps, **kw), params)
    b, ob = _run(lambda ps: theirs(ps, foreach=False, **kw), params)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)
        sx, sy = oa.state[x], ob.state[y]
        assert float(sx["step"]) == float(sy["step"]) == 5
        torch.testing.assert_close(sx["exp_avg"], sy["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sx["exp_avg_sq"], sy["exp_avg_sq"], rtol=1e-6, atol=1e-7)
    # The step moved the weights (a no-op kernel would still "match" a zero lr).
    assert not torch.allclose(a[0], params[0])


def test_grad_scale_is_read_in_the_pass():
    params = _params()
    # eps comparable to the moments: Adam's update then depends on the gradient's scale.
    a, _ = _run(lambda ps: optim.CPUAdamW(ps, lr=1e-2, eps=0.1), params, grad_scale=0.37)
    b, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=0.1, foreach=False), params, grad_scale=0.37)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)
    c, _ = _run(lambda ps: optim.CPUAdamW(ps, lr=1e-2, eps=0.1), params)
    assert (a[1] - c[1]).abs().max() > 1e-3


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_matches_torch(kw):
    params = _params()
    a, oa = _run(lambda ps: optim.CPUSGD(ps, **kw), params)
    b, ob = _run(lambda ps: torch.optim.SGD(ps, foreach=False, **kw), params)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)
        if kw.get("momentum"):
            torch.testing.assert_close(oa.state[x]["momentum_buffer"], ob.state[y]["momentum_buffer"])


TORCH_PAIRS = [(optim.CPUAdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
               (optim.CPUAdam, torch.optim.Adam, dict(weight_decay=0.1)),
               (optim.CPUSGD, torch.optim.SGD, dict(momentum=0.9))]


@pytest.mark.parametrize("ours, theirs, kw", TORCH_PAIRS, ids=["AdamW", "Adam", "SGD"])
def test_tensor_lr_is_read_at_every_step_like_torch(ours, theirs, kw):
    """lr as a one-element tensor, changed in place between steps by an LR scheduler:
    every step uses its value then, as torch's optimizer does."""
    results = []
    for make in (ours, lambda ps, **k: theirs(ps, foreach=False, **k)):
        lr = torch.tensor(0.05)
        ps, opt = _run(lambda ps: make(ps, lr=lr, **kw), _params(), steps=0)
        assert opt.param_groups[0]["lr"] is lr  # held, not copied: in-place changes reach the step
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.3 ** step)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            schedule.step()
        results.append(ps)
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("ours, theirs, kw", TORCH_PAIRS, ids=["AdamW", "Adam", "SGD"])
def test_torch_implementation_switches_are_accepted_and_change_nothing(ours, theirs, kw):
    """foreach and fused choose among torch's kernels; ours is always one fused pass, so
    each value torch accepts steps as the default does and is kept in the param group."""
    reference, _ = _run(lambda ps: ours(ps, lr=1e-2, **kw), _params())
    for foreach, fused in ((None, None), (False, False), (True, None), (True, False), (False, True), (None, True)):
        ps, opt = _run(lambda ps: ours(ps, lr=1e-2, foreach=foreach, fused=fused, **kw), _params())
        assert (opt.param_groups[0]["foreach"], opt.param_groups[0]["fused"]) == (foreach, fused)
        for x, y in zip(ps, reference):
            assert torch.equal(x, y), f"foreach={foreach}, fused={fused} changed the step"
    if theirs is not torch.optim.SGD:  # torch's positional amsgrad, and Adam's decoupled form
        ps, _ = _run(lambda ps: ours(ps, 1e-2, (0.9, 0.999), 1e-8, 0.1, False), _params())
        for x, y in zip(ps, reference):
            assert torch.equal(x, y)
        a, _ = _run(lambda ps: optim.CPUAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), _params())
        b, _ = _run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False), _params())
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)


def test_torch_options_the_kernel_lacks_are_refused_naming_them():
    r = [torch.nn.Parameter(torch.randn(4))]
    for cls in (optim.CPUAdamW, optim.CPUAdam):
        with pytest.raises(ValueError, match=rf"{cls.__name__}: capturable=True is not supported: .*CUDA graph"):
            cls(r, capturable=True)
        with pytest.raises(ValueError, match="amsgrad=True is not supported"):
            cls(r, amsgrad=True)
    for cls in (optim.CPUAdamW, optim.CPUAdam, optim.CPUSGD):
        with pytest.raises(ValueError, match="differentiable=True is not supported: .*outside autograd"):
            cls(r, differentiable=True)
        with pytest.raises(ValueError, match="fused=True and foreach=True cannot be set together"):
            cls(r, foreach=True, fused=True)
        with pytest.raises(TypeError, match="foreach must be None or a bool"):
            cls(r, foreach="yes")
        with pytest.raises(ValueError, match=r"Tensor lr must be a one-element float tensor, .* shape \(2,\)"):
            cls(r, lr=torch.tensor([0.1, 0.2]))
        with pytest.raises(ValueError, match="invalid lr: -1.0"):
            cls(r, lr=torch.tensor(-1.0))


def test_state_dicts_interchange_with_torch():
    params = _params()
    a, oa = _run(lambda ps: optim.CPUAdamW(ps, lr=1e-2, weight_decay=0.1), params, steps=3)
    ps = [torch.nn.Parameter(p.detach().clone()) for p in a]
    ob = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False)
    import copy
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    qs = [torch.nn.Parameter(p.detach().clone()) for p in a]
    oc = optim.CPUAdamW(qs, lr=1e-2, weight_decay=0.1)
    oc.load_state_dict(copy.deepcopy(oa.state_dict()))
    g = torch.Generator().manual_seed(7)
    for p, q in zip(ps, qs):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    ob.step()
    oc.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6)
    assert float(oc.state[qs[0]]["step"]) == 4


def test_threads_split_work_identically():
    params = _params(shapes=((300001,),))
    before = optim.num_threads()
    try:
        optim.set_num_threads(1)
        a, _ = _run(lambda ps: optim.CPUAdamW(ps, lr=1e-2), params)
        optim.set_num_threads(3)
        assert optim.num_threads() == 3
        b, _ = _run(lambda ps: optim.CPUAdamW(ps, lr=1e-2), params)
    finally:
        optim.set_num_threads(0)
    assert torch.equal(a[0], b[0])
    assert optim.num_threads() == torch.get_num_threads() or before >= 1


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_copy_out_is_the_rounded_weight(kind):
    p = torch.randn(100003)
    g = torch.randn(100003)
    out_bf16 = torch.empty(100003, dtype=torch.bfloat16)
    out_f32 = torch.empty(100003)
    for out in (out_bf16, out_f32):
        q = p.clone()
        if kind == "adam":
            hyper = _C.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                                 decoupled_weight_decay=True, maximize=False)
            _C.adam_step([q], [g], [torch.zeros_like(q)], [torch.zeros_like(q)], [out], [1], hyper)
        else:
            hyper = _C.SgdHyper(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
            _C.sgd_step([q], [g], [], [out], [], hyper)
        assert not torch.equal(q, p)
        assert torch.equal(out, q.to(out.dtype))  # round to nearest even, as torch casts
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, 1e-40])
    out = torch.empty(5, dtype=torch.bfloat16)
    hyper = _C.SgdHyper(lr=0.0, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    _C.sgd_step([special.clone()], [torch.zeros(5)], [], [out], [], hyper)
    ref = special.to(torch.bfloat16)
    assert torch.isnan(out[0]) and torch.equal(out[1:], ref[1:])


def test_bad_input_raises_naming_it():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    p.grad = torch.randn(4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="steps float32 master weights"):
        optim.CPUAdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(4, 4).t())
    q.grad = torch.randn(4, 4).t()
    with pytest.raises(RuntimeError, match="contiguous"):
        optim.CPUAdamW([q]).step()
    r = torch.nn.Parameter(torch.randn(4))
    r.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        optim.CPUSGD([r], lr=0.1).step()
    with pytest.raises(ValueError, match="invalid beta parameter at index 1"):
        optim.CPUAdamW([r], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="invalid lr"):
        optim.CPUAdamW([r], lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.CPUSGD([r], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="has 3 elements, its parameter 4"):
        hyper = _C.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                             decoupled_weight_decay=True, maximize=False)
        x = torch.randn(4)
        _C.adam_step([x], [torch.randn(3)], [torch.zeros(4)], [torch.zeros(4)], [None], [1], hyper)
    with pytest.raises(ValueError, match="counts from 1"):
        x = torch.randn(4)
        _C.adam_step([x], [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], [None], [0], hyper)


def test_no_grad_params_are_skipped():
    ps = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))]
    before = ps[1].detach().clone()
    ps[0].grad = torch.randn(5)
    opt = optim.CPUAdamW(ps)
    opt.step()
    assert torch.equal(ps[1].detach(), before) and ps[1] not in opt.state


@pytest.mark.parametrize("overlap_step", [False, True])
def test_a_copied_or_reloaded_optimizer_steps_as_the_original(overlap_step):
    """copy.deepcopy and torch.save/torch.load keep torch's hyper-parameters and state and
    the overlap setting, and the copy steps (the background queue is built anew)."""
    import copy
    import io

    from megatron_fsdp_ext.optim import CPUAdamW

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    p.grad = torch.randn(300)
    opt = CPUAdamW([p], lr=0.1, weight_decay=0.1, overlap_step=overlap_step)
    opt.step()
    opt.synchronize()
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    copies = [copy.deepcopy(opt), torch.load(buf, weights_only=False)]
    grad = torch.randn(300)
    p.grad = grad.clone()
    opt.step()
    opt.synchronize()
    for other in copies:
        assert other.overlap_step == overlap_step
        q = other.param_groups[0]["params"][0]
        q.grad = grad.clone()
        other.step()
        other.synchronize()
        assert torch.equal(q, p), "the copy stepped differently"


def test_options_the_kernel_lacks_are_refused_when_a_loaded_state_dict_sets_them():
    """torch's AdamW state dict with amsgrad=True loads into CPUAdamW's param groups: its
    next step refuses with the constructor's ValueError rather than stepping without it."""
    p = torch.nn.Parameter(torch.randn(4))
    theirs = torch.optim.AdamW([p], lr=1e-2, amsgrad=True)
    p.grad = torch.randn(4)
    theirs.step()
    ours = optim.CPUAdamW([p], lr=1e-2)
    ours.load_state_dict(theirs.state_dict())
    with pytest.raises(ValueError, match="CPUAdamW: amsgrad=True .*from a loaded torch state dict.* not supported"):
        ours.step()
