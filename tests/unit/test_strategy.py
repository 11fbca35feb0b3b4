"""The strategy descriptor (csrc/strategy.h): names, errors, and what each strategy means.

The expected table below is Megatron-FSDP's definition of its four strategies, written
out independently of the C++ table; tests/distributed/test_strategies.py checks the
behaviour that follows from it against plain PyTorch."""
import pytest

from megatron_fsdp_ext import _C
from megatron_fsdp_ext.core.options import UnitOptions
from megatron_fsdp_ext.core.strategy import SHARDING_STRATEGIES, sharding_strategy

#            replicated, gathers, keeps_unsharded, keeps_gathered, full_grads
EXPECTED = {
    "no_shard": (True, False, True, False, True),            # DDP-like: nothing sharded
    "optim": (False, True, True, True, True),                # ZeRO-1: full all-reduced grads
    "optim_grads": (False, True, True, True, False),         # ZeRO-2: grads reduce-scattered
    "optim_grads_params": (False, True, False, False, False),  # ZeRO-3: gathered per use
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_strategy_means_what_megatron_says(name):
    s = sharding_strategy(name)
    assert s is SHARDING_STRATEGIES[name] and s.megatron_name == name
    assert _C.ShardingStrategy.from_name(name) == s
    assert (s.replicated, s.gathers, s.keeps_unsharded, s.keeps_gathered, s.full_grads) == EXPECTED[name]


def test_every_strategy_is_listed_once_in_enum_order():
    assert list(SHARDING_STRATEGIES) == ["no_shard", "optim", "optim_grads", "optim_grads_params"]
    assert [int(s) for s in _C.sharding_strategies()] == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", ["zero3", "", None, 3])
def test_unknown_strategy_names_the_choices(bad):
    with pytest.raises(ValueError, match="unknown sharding_strategy .*choose from 'no_shard', 'optim'"):
        sharding_strategy(bad)
    with pytest.raises(ValueError, match="unknown sharding_strategy"):
        UnitOptions(sharding_strategy=bad, reshard_after_forward=False)


def test_cpp_lookup_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown sharding_strategy 'zero3'; choose from 'no_shard'"):
        _C.ShardingStrategy.from_name("zero3")


def test_options_read_the_descriptor():
    assert UnitOptions(sharding_strategy="optim_grads_params").keeps_params_unsharded is False
    for name in ("no_shard", "optim", "optim_grads"):
        options = UnitOptions(sharding_strategy=name, reshard_after_forward=False)
        assert options.keeps_params_unsharded and options.strategy is SHARDING_STRATEGIES[name]
        with pytest.raises(ValueError, match="keeps parameters unsharded between uses"):
            UnitOptions(sharding_strategy=name, reshard_after_forward=True)
