"""Bad input gets a clear error naming the problem."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron_fsdp_ext as mfsdp
from megatron_fsdp_ext.models import LlamaConfig, LlamaModel
from harness import run_distributed
from harness.workers import expect_error, flat_piece


def test_process_group_not_initialized():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        mfsdp.fully_shard(nn.Linear(2, 2))


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_non_floating_mixed_precision_dtype(field):
    with pytest.raises(ValueError, match=f"{field} must be a floating-point dtype"):
        mfsdp.MixedPrecisionPolicy(**{field: torch.int32})
    with pytest.raises(TypeError, match=f"{field} must be a torch.dtype"):
        mfsdp.MixedPrecisionPolicy(**{field: "bf16"})


def _bad_inputs(rank, world):
    cfg = LlamaConfig(n_layers=2)

    # fully_shard twice on one module.
    m = LlamaModel(cfg)
    mfsdp.fully_shard(m.blocks[0])
    expect_error(lambda: mfsdp.fully_shard(m.blocks[0]), ValueError, "already called", "Block")

    # Outer unit wrapped before its inner units.
    m = LlamaModel(cfg)
    mfsdp.fully_shard(m)
    expect_error(lambda: mfsdp.fully_shard(m.blocks[1]), ValueError, "bottom-up", "attn_norm.weight")

    # Blocks sharded by torch's own fully_shard (FSDP2), the root by ours: named as such,
    # not taken for tensor parallelism (FSDP2's parameters are DTensors).
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    m = LlamaModel(cfg)
    for block in m.blocks:
        torch_fully_shard(block)
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "module 'blocks.0'", "sharded by torch's own fully_shard")
    expect_error(lambda: mfsdp.fully_shard(m.blocks[1]), ValueError, "this module", "torch's own fully_shard")

    # Parameters partly on the meta device; a meta unit used before materialize().
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "'1.weight' is on the meta device", "'0.weight' is not")
    deferred = mfsdp.fully_shard(nn.Linear(2, 2, device="meta"))
    expect_error(lambda: deferred(torch.zeros(1, 2)), RuntimeError, "meta device", "materialize(model)")
    m = nn.Linear(2, 2)

    # Gloo group with parameters not on CPU is covered in the GPU suite; here: wrong type.
    expect_error(lambda: mfsdp.fully_shard(m, mp_policy={"param_dtype": torch.bfloat16}), TypeError, "MixedPrecisionPolicy")

    # Integer parameter.
    m = nn.Module()
    m.w = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "'w' has non-floating dtype torch.int64")
    m.w = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    expect_error(lambda: mfsdp.fully_shard(m), ValueError, "'w' has complex dtype torch.complex64",
                 "torch.view_as_real(w)")

    # Mixed dtypes inside one unit.
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    expect_error(lambda: mfsdp.fully_shard(m), RuntimeError, "single parameter dtype", "1.weight")

    # Tied parameter across two units.
    m = LlamaModel(cfg)
    m.blocks[0].mlp.w_down.weight = m.blocks[1].mlp.w_down.weight
    mfsdp.fully_shard(m.blocks[1])
    expect_error(lambda: mfsdp.fully_shard(m.blocks[0]), ValueError, "tied", "mlp.w_down.weight")

    # Replacing the data of a sharded parameter with a different shape.
    m = LlamaModel(cfg)
    for b in m.blocks:
        mfsdp.fully_shard(b)
    mfsdp.fully_shard(m)
    m.blocks[0].mlp.w_down.weight.data = torch.zeros(5)
    expect_error(lambda: m(torch.zeros(1, 4, dtype=torch.long)), RuntimeError, "mlp.w_down.weight", "was replaced")


def test_bad_inputs_world2():
    run_distributed(_bad_inputs, 2, timeout=120)


def test_groups_over_other_ranks_are_refused():
    from harness.workers import mismatched_group_errors
    run_distributed(mismatched_group_errors, 4, timeout=120)


def test_unsupported_float_dtypes_are_refused_at_the_policy():
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64):
        with pytest.raises(ValueError, match="param_dtype must be a floating-point dtype"):
            mfsdp.MixedPrecisionPolicy(param_dtype=dtype)


def _misuse(rank, world):
    # ignored_params given as one tensor instead of an iterable of them.
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    expect_error(lambda: mfsdp.fully_shard(m, ignored_params=m[0].bias), TypeError,
                 "ignored_params must be an iterable")
    expect_error(lambda: mfsdp.fully_shard_model(m, mfsdp.FSDPConfig(), ignored_params=m[0].bias), TypeError,
                 "ignored_params must be an iterable")

    # An optimizer built before fully_shard holds the replaced parameters: refused at its
    # first step (it would train nothing), and again at the next; one built after works.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    early = torch.optim.AdamW(m.parameters(), lr=0.1)
    mfsdp.fully_shard(m[0])
    mfsdp.fully_shard(m)
    m(torch.randn(3, 4)).sum().backward()
    for _ in range(2):
        expect_error(early.step, RuntimeError, "AdamW holds 4 parameter(s) that fully_shard replaced",
                     "Build the optimizer after fully_shard")
    # Adafactor factors by shape and scales by the parameter's RMS: a 1-D piece trains
    # differently, so it is refused at its first step (on every rank alike).
    factored = torch.optim.Adafactor(m.parameters(), lr=0.01)
    expect_error(factored.step, NotImplementedError, "Adafactor holds fully_shard parameters", "1-D piece")
    # Muon accepts the matrices (they report their 2-D shapes) but would orthogonalize
    # pieces; LBFGS's dot products and stopping tests would be each rank's own.
    muon = torch.optim.Muon([p for p in m.parameters() if p.dim() == 2], lr=0.01)
    expect_error(muon.step, NotImplementedError, "Muon holds fully_shard parameters", "LayerwiseDistributedOptimizer")
    lbfgs = torch.optim.LBFGS(m.parameters())
    expect_error(lambda: lbfgs.step(lambda: m(torch.randn(3, 4)).sum()), NotImplementedError,
                 "LBFGS holds fully_shard parameters", "numbers of closure calls")
    late = torch.optim.AdamW(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    late.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, m.parameters())), "the optimizer changed nothing"


def test_misuse_is_refused_clearly():
    run_distributed(_misuse, 2, timeout=120)


class _NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)  # a buffer the refused conversion must leave as it was

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)))


def _conversions_after_fully_shard(rank, world):
    import copy

    from harness.workers import gather_full_grads

    torch.manual_seed(0)
    plain = nn.Sequential(_NormedBlock(), _NormedBlock(), nn.Linear(8, 1))
    net = copy.deepcopy(plain)
    for block in net[:2]:
        mfsdp.fully_shard(block)
    mfsdp.fully_shard(net)
    # A device change of the shards, and a dtype change of plain modules inside units
    # (model.norm.float() to keep a norm in fp32: nn.Module._apply swaps .data, which the
    # unit would undo silently): the flat buffers cannot follow, refused before anything
    # is converted. (A whole unit's dtype change works: test_convert_and_assign.py.)
    for convert, to in ((lambda m: m.double(), "torch.float64"), (lambda m: m.half(), "torch.float16"),
                        (lambda m: m.to(torch.bfloat16), "torch.bfloat16"), (lambda m: m.to("meta"), "meta")):
        for target in (net, net[1]) if to == "meta" else (net[1].lin, net[1].norm, net[2]):
            expect_error(lambda: convert(target), RuntimeError, "cannot change its sharded parameters", to,
                         "before fully_shard")
    assert all(b.dtype in (torch.float32, torch.int64) for b in net.buffers()), \
        [b.dtype for b in net.buffers()]
    assert all(p.dtype == torch.float32 for p in net.parameters())
    # Conversions that change nothing still work, and training is plain PyTorch's after them.
    net.float()
    net.to("cpu")
    net.to(torch.float32)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    net(x).sum().backward()
    xs = [torch.randn(6, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    (sum(plain(xr).sum() for xr in xs) / world).backward()
    full = gather_full_grads(net, replicated=False)
    for name, p in plain.named_parameters():
        torch.testing.assert_close(full[name], flat_piece(p.grad), rtol=1e-5, atol=1e-6)
    # A device move of a plain module inside a unit replaces its parameters (nn.Module._apply
    # cannot swap .data across devices): refused when the unit finds them, at the next use,
    # instead of copying the values back into the unit as if nothing had moved.
    net[2].to("meta")
    expect_error(lambda: net(x), RuntimeError, "cannot change its sharded parameters", "on meta",
                 "before fully_shard")


def test_device_and_partial_dtype_conversions_after_fully_shard_are_refused():
    run_distributed(_conversions_after_fully_shard, 2, timeout=120)


def _replacements_refused_alike(rank, world):
    # A parameter tied to another after fully_shard (another unit's, or this unit's): its
    # values are that parameter's piece. Once copied as this rank's piece of the head: the
    # tie was silently cut (and, where pieces differ in length, refused on some ranks only).
    for same_unit in (False, True):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
        if not same_unit:
            mfsdp.fully_shard(m[0])
        mfsdp.fully_shard(m)
        m[1].weight = m[0].weight
        expect_error(lambda: m(torch.tensor([[1, 2, 3]])), ValueError, "weight' of",
                     "tied after fully_shard", "before fully_shard")

    # A replacement the length of one rank's piece (16 elements of the (3, 8) weight on
    # rank 0, 8 on rank 1): decided by the full shape on every rank, not taken as a piece.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 3))
    mfsdp.fully_shard(m)
    first_piece = torch.tensor([m[1].weight.detach().numel()])
    dist.broadcast(first_piece, 0)
    assert first_piece.item() != m[1].weight.detach().numel() or rank == 0 or world == 1
    m[1].weight = nn.Parameter(torch.zeros(first_piece.item()))
    expect_error(lambda: m(torch.ones(1, 2)), ValueError, "replaced by one of shape", "the parameter's shape is (3, 8)")
    # A replacement of another dtype: in plain PyTorch the parameter would change dtype;
    # the unit's flat buffer cannot, and casting the value in would hide it.
    m = nn.Sequential(nn.Linear(2, 8), nn.Linear(8, 3))
    mfsdp.fully_shard(m)
    m[1].weight = nn.Parameter(torch.zeros(3, 8, dtype=torch.float64))
    expect_error(lambda: m(torch.ones(1, 2)), RuntimeError, "cannot change its sharded parameters",
                 "torch.float32 on cpu to torch.float64 on cpu")

    # An embedding that renormalizes its rows in place during forward (max_norm).
    for cls in (nn.Embedding, nn.EmbeddingBag):
        emb = nn.Sequential(cls(8, 4, max_norm=1.0))
        expect_error(lambda: mfsdp.fully_shard(emb), NotImplementedError, "max_norm=1.0", "in place")
        sparse = nn.Sequential(cls(8, 4, sparse=True))
        expect_error(lambda: mfsdp.fully_shard(sparse), NotImplementedError, "sparse=True", "sparse=False")

    # A deep copy of a sharded model (torch's AveragedModel makes one): once a TypeError from
    # the module's constructor, called without its arguments.
    import copy
    m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    mfsdp.fully_shard(m[1])
    mfsdp.fully_shard(m)
    for make_copy in (copy.deepcopy, torch.optim.swa_utils.AveragedModel):
        expect_error(lambda: make_copy(m), TypeError, "copy.deepcopy of a fully_shard module", "before fully_shard")


def test_replacements_and_writes_in_forward_are_refused_on_every_rank():
    run_distributed(_replacements_refused_alike, 2, timeout=120)


def _param_added_after_fully_shard(rank, world):
    """A trainable parameter registered inside a unit after fully_shard is neither sharded
    nor reduced: refused at the optimizer's first step, naming it; ignored_params and the
    parameters of nested units and of modules outside every unit are not."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 2))
    mfsdp.fully_shard(m[1])
    mfsdp.fully_shard(m, ignored_params=[m[0].bias])
    outside = nn.Linear(2, 2)  # not in any unit: the script's own business
    m(torch.randn(2, 4)).sum().backward()
    ok = torch.optim.SGD(list(m.parameters()) + list(outside.parameters()), lr=0.1)
    ok.step()
    m[1].add_module("extra", nn.Linear(4, 4))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    expect_error(opt.step, NotImplementedError, "'extra.weight'", "added to the unit's modules after fully_shard")
    # An optimizer checked before meets the parameter through add_param_group.
    ok.add_param_group({"params": list(m[1].extra.parameters())})
    expect_error(ok.step, NotImplementedError, "'extra.weight'")
    frozen = torch.optim.SGD([p for p in m.parameters() if p is not m[1].extra.weight and p is not m[1].extra.bias])
    frozen.step()
    return True


def test_parameters_added_inside_a_unit_after_fully_shard_are_refused_at_the_step():
    assert run_distributed(_param_added_after_fully_shard, 2, timeout=120) == [True, True]


def _keys_on_some_ranks(rank, world):
    """load_state_dict with a key passed on rank 0 only (Accelerate's FULL_STATE_DICT load
    of PEFT adapters: the file on rank 0, {} elsewhere) raises on every rank, naming it,
    where the ranks once waited in different collectives forever."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    mfsdp.fully_shard(m[0])
    mfsdp.fully_shard(m)
    full = mfsdp.full_state_dict(m, rank0_only=False)
    values = {"0.weight": full["0.weight"] * 2} if rank == 0 else {}
    expect_error(lambda: m.load_state_dict(values, strict=False), ValueError, "'0.weight'",
                 "passed on some ranks and not on others")
    m.load_state_dict({"0.weight": full["0.weight"] * 2}, strict=False)  # the same keys everywhere: loads
    torch.testing.assert_close(mfsdp.full_state_dict(m, rank0_only=False)["0.weight"], full["0.weight"] * 2)
    return True


def test_load_state_dict_with_keys_on_some_ranks_only_raises_on_every_rank():
    assert run_distributed(_keys_on_some_ranks, 2, timeout=120) == [True, True]
