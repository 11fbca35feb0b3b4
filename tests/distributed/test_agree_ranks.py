"""agree.Agreement on 2 Gloo ranks: a failure on any rank raises on every rank, a failing
rank gets its own exception back (with a note naming the others), a check sees every
rank's share and outranks failures, and each agreement is one collective per group."""
from harness import run_distributed


class Refused(RuntimeError):
    pass


def _outcomes(rank, world):
    import torch.distributed as dist

    from megatron_fsdp_ext.core.agree import Agreement

    gathers = []
    real = dist.all_gather_object

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    dist.all_gather_object = counting
    pair = dist.new_group([0, 1])

    def outcome(fail_on=(), **options):
        mine = ValueError(f"bad input on rank {rank}")
        before = len(gathers)
        try:
            with Agreement("step", error=Refused, tail="; nothing done", **options) as agreed:
                if rank in fail_on:
                    raise mine
        except Exception as e:
            return type(e).__name__, str(e), list(getattr(e, "__notes__", [])), e is mine, len(gathers) - before
        return "ok", agreed.shared, len(gathers) - before

    def differ(shared, _):
        if len(set(shared.values())) > 1:
            raise Refused(f"shares differ: {shared}")

    try:
        return {
            "none": outcome(share=f"s{rank}"),
            "one": outcome((1,)),
            "both": outcome((0, 1)),
            "check": outcome((1,), share=rank, check=differ),
            "groups": outcome((0,), group=[pair, None]),
            "groups_ok": outcome(group=[pair, None], share=lambda: rank * 10),
        }
    finally:
        dist.all_gather_object = real


def test_agreement_two_ranks():
    r0, r1 = run_distributed(_outcomes, 2, timeout=60)
    assert r0["none"] == ("ok", {0: "s0", 1: "s1"}, 1) and r1["none"] == r0["none"]
    # The failing rank: its own exception, untouched; the other: `error`, naming it.
    assert r1["one"] == ("ValueError", "bad input on rank 1", [], True, 1)
    assert r0["one"] == ("Refused", "step: failed on rank(s) [1]: rank 1: ValueError: bad input on rank 1; nothing done",
                         [], False, 1)
    # Both failed: each its own, with a note naming the other.
    for rank, got in ((0, r0["both"]), (1, r1["both"])):
        other = 1 - rank
        assert got == ("ValueError", f"bad input on rank {rank}",
                       [f"step: also failed on rank {other}: ValueError: bad input on rank {other}"], True, 1)
    # A disagreement the check finds outranks the failure, on every rank.
    for got in (r0["check"], r1["check"]):
        assert got == ("Refused", "shares differ: {0: 0, 1: 1}", [], False, 1)
    # Several groups: one gather each, stopping at the first that saw a failure.
    assert r0["groups"] == ("ValueError", "bad input on rank 0", [], True, 1)
    assert r1["groups"] == ("Refused", "step: failed on rank(s) [0]: rank 0: ValueError: bad input on rank 0; "
                            "nothing done", [], False, 1)
    assert r0["groups_ok"] == r1["groups_ok"] == ("ok", {0: 0, 1: 10}, 2)
