"""adapt."""
