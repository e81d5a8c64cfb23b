"""Runtime: process groups (``mesh``) and the tensor-parallel collectives (``collectives``)."""
