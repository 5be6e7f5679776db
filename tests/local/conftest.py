"""Local-mode tests: one process, several CPU devices (8, set in tests/conftest.py)."""
