"""FSDPConfig(bucket_size=...) picks units bottom-up by size; only modules that run
forward qualify (a ModuleList's hooks never fire) and a tied parameter is never split
across units (fully_shard would refuse it)."""
import torch.nn as nn

from megatron_fsdp_ext.tools.config import _size_based_units


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)  # 800 elements
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # 72 each, 288 in all
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Tied()
        self.extra = nn.Linear(8, 8)

    def forward(self, x):
        return self.inner(x)


def test_containers_are_never_units():
    model = Tied()
    units = _size_based_units(model, 200, set())
    assert model.layers not in units  # 288 >= 200, but nobody calls a ModuleList
    assert units == []  # each Linear (72) is below the bucket


def test_tied_parameters_stay_in_one_unit():
    model = Tied()
    units = _size_based_units(model, 50, set())
    assert model.emb not in units and model.head not in units  # either one would split the tie
    assert units == list(model.layers)
    wrapped = Wrapper()
    units = _size_based_units(wrapped, 1000, set())
    assert units == [wrapped.inner]  # holds both ends of the tie (1088 elements)


def test_ignored_and_shared_parameters_counted_once():
    model = Tied()
    # the tied weight counts once (800), and ignoring it leaves the layers' 288
    assert _size_based_units(Wrapper(), 1089, set()) == []
    assert _size_based_units(model, 1, {id(model.emb.weight)}) == list(model.layers)
