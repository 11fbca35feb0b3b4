"""The explicit states of a root and of its units (hooks.py drives them; state_dict.py,
dcp.py and checkpoint.py read SlotsHold to refuse work inside forward/backward)."""
import enum


class RootPhase(enum.Enum):
    """Where the root's units are in a training step."""
    IDLE = "idle"  # forward, or between steps
    BACKWARD = "backward"  # from the first backward hook until the final callback ran


class ForwardOrder(enum.Enum):
    """The root's record of the order its units' forwards run in (for prefetching)."""
    RECORDING = "recording"  # until the first backward ends
    FROZEN = "frozen"


class BackwardProgress(enum.Enum):
    """How far one unit's backward got in the current backward, in order (reset by the
    next grad-enabled forward and by the final callback). A reduced unit is never
    gathered again in the same backward."""
    NONE = "none"
    GATHERED = "gathered"  # pre-backward ran: parameters gathered for backward
    REDUCED = "reduced"  # post-backward ran: gradients reduced


class GraphHold(enum.Enum):
    """Whether a backward with create_graph=True (a gradient penalty's autograd.grad) built
    a graph that reads this unit's gathered parameters: that graph's own backward reads
    them again, so they stay gathered, and the unit reduces only at the end of the next
    backward, once the gradients of both graphs have landed."""
    NONE = "none"
    HELD = "held"  # gathered parameters kept for a higher-order graph


class SlotsHold(enum.Enum):
    """Which parameters the module's parameter slots hold."""
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class ParamInit(enum.Enum):
    """Whether a unit's shard holds the parameters' values yet."""
    MATERIALIZED = "materialized"
    DEFERRED = "deferred"  # built on the meta device: materialize() writes the values
