"""How long a collective may take before it raises instead of hanging: ``DEFAULT_TIMEOUT``
(300 s), or ``AUTOTP_TIMEOUT`` seconds, for a world autotp starts; a group's own timeout as
torch holds it (see :mod:`autotp.distributed.mesh`)."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from autotp.errors import ConfigError

DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)
TIMEOUT_ENV = "AUTOTP_TIMEOUT"


def collective_timeout() -> datetime.timedelta:
    """The timeout a world started by autotp gets: ``AUTOTP_TIMEOUT`` seconds, else the default."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={text!r} is not a positive number of seconds "
                          f"(unset it for the default of {DEFAULT_TIMEOUT.total_seconds():g} s)")
    return datetime.timedelta(seconds=seconds)


def group_timeout(group=None) -> datetime.timedelta:
    """The collective timeout of ``group`` (None: the default group)."""
    try:  # private API; the fallback is only a different timeout, never a wrong result
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda"):
            try:
                return pg._get_backend(torch.device(device)).options._timeout
            except Exception:
                continue
    except Exception:
        pass
    return DEFAULT_TIMEOUT
