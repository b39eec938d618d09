"""Test-wide settings."""

from hypothesis import settings

# No per-example wall-clock deadline: on a shared 2-core machine an example's time
# measures the load, not the code (test_layout's chunk_range test failed on the 200 ms
# default under load). A hang is still caught by pytest-timeout.
settings.register_profile("nereus", deadline=None)
settings.load_profile("nereus")
