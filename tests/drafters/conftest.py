"""The drafter tests use the whole suite's fixtures (tests/conftest.py: the tiny Llama, the oracle run)."""
