"""Generated training steps for the program fuzzer (tests/local/test_fuzz_programs.py)."""
