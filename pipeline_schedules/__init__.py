"""Pipeline schedules beyond the plain 1F1B of `pipeline.py`: `interleave` (virtual stages)."""
