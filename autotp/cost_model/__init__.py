"""Cost model: what an op or a collective costs on a device profile (symbolic in batch and
sequence, priced by a profile), and calibration of a profile on the machine at hand."""
from .calibration import calibrate  # noqa: F401
from .devices import PROFILES, DeviceProfile, get_profile  # noqa: F401
