"""autotp: automatic Megatron-style tensor parallelism for unmodified PyTorch transformers.

    plan = autotp.plan(model, tp=8)          # no process group needed; a meta model works
    pm = autotp.parallelize(model, tp=8)     # inside an initialized torch.distributed world
    pm = autotp.from_pretrained(folder, tp=8)  # the same, reading only this rank's slices of a checkpoint
"""
from .api import from_pretrained, parallelize, plan
from .errors import (AutotpError, CaptureError, CheckpointError, CommError, ConfigError, DisagreementError,
                     InputError, LostRankError, MemoryLimitError, NoRuleError, PlanError, SolverError)
from .placements import Partial, Replicate, Shard
from .plan import Plan
from .plan.expert_load import ExpertLoad
from .planner.expert_load import measure_expert_load
from .version import __version__

__all__ = [
    "from_pretrained", "parallelize", "plan", "Plan", "Replicate", "Shard", "Partial", "AutotpError", "CaptureError",
    "CheckpointError", "CommError", "ConfigError", "DisagreementError", "InputError", "LostRankError",
    "MemoryLimitError", "NoRuleError", "PlanError", "SolverError", "ExpertLoad", "measure_expert_load",
]
