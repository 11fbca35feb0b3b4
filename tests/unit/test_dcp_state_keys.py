"""How load_checkpoint splits a stored optimizer key into parameter name and state key."""
from megatron_fsdp_ext.checkpoint.dcp_flat import split_state_key as _split_state_key

KNOWN = {"blocks.0.w.weight", "blocks.0.w", "head.weight"}


def test_plain_state_key():
    assert _split_state_key("blocks.0.w.weight.exp_avg", KNOWN) == ("blocks.0.w.weight", "exp_avg")


def test_state_key_with_dots_keeps_the_longest_parameter_name():
    # 'blocks.0.w' is also a known name: the longer 'blocks.0.w.weight' must win.
    assert _split_state_key("blocks.0.w.weight.ema.decay", KNOWN) == ("blocks.0.w.weight", "ema.decay")
    assert _split_state_key("head.weight.a.b.c", KNOWN) == ("head.weight", "a.b.c")


def test_unknown_parameter():
    assert _split_state_key("nope.exp_avg", KNOWN) == (None, None)
    assert _split_state_key("head.weight", KNOWN) == (None, None)  # no state key left
