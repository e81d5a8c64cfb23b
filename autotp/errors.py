"""One error family: every failure autotp can foresee names the thing and the fix."""


class AutotpError(Exception):
    """Base class of every error autotp raises on purpose."""


class ConfigError(AutotpError, ValueError):
    """A bad argument: a tp that cannot work, a world that does not divide, ..."""


class CaptureError(AutotpError):
    """The model could not be captured as a graph."""


class NoRuleError(AutotpError):
    """An op has no sharding rule (autotp replicates it and warns instead of raising)."""


class PlanError(AutotpError):
    """No valid plan: a dimension does not divide, a memory limit cannot be met, ..."""


class MemoryLimitError(PlanError):
    """No plan fits the memory limit per rank, though plans without the limit exist. Its message
    says what the fastest plan needs (training state and activations against the limit);
    ``needed_bytes`` (per rank, the largest), ``state_bytes``, ``activation_bytes`` and
    ``limit_bytes`` hold the numbers (0 where unknown).

    ``plan_without_limit``: where :func:`autotp.plan` raised it, a function that returns the plan
    ``memory_limit=float("inf")`` would give (the fastest one), built from the search that found
    none fits, without solving again; else None."""

    def __init__(self, message: str, needed_bytes: float = 0.0, state_bytes: float = 0.0,
                 activation_bytes: float = 0.0, limit_bytes: float = 0.0):
        super().__init__(message)
        self.needed_bytes, self.state_bytes, self.activation_bytes = needed_bytes, state_bytes, activation_bytes
        self.limit_bytes = limit_bytes
        self.plan_without_limit = None


class SolverError(PlanError):
    """The solver's own choices do not replay as it priced them: a bug in autotp, never the
    input's fault. Not taken for "no plan this way": where another way to plan exists (sibling
    products apart rather than joined) autotp logs it and plans that way, else it is raised."""


class InputError(AutotpError, ValueError):
    """A call's inputs do not fit the captured graph (too long, wrong keys, ...)."""


class CommError(AutotpError, RuntimeError):
    """A collective failed: a lost rank, a timeout, ranks that disagree."""


class CheckpointError(AutotpError):
    """A checkpoint does not match the model: a missing key, a wrong shape."""


class DisagreementError(CommError):
    """The ranks of a TP group would run different programs: their plans, rewritten graphs or
    input shapes differ. Raised on every rank of the group, before the collectives that would
    otherwise hang or silently mix unrelated tensors."""


class LostRankError(CommError):
    """A collective failed because a rank of the group is gone (its process died) or never
    joined; the message names it."""
