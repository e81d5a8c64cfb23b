"""Cost model: what an op or a collective costs on a device profile."""
from .devices import PROFILES, DeviceProfile, get_profile  # noqa: F401
