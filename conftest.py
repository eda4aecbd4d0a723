"""The suite's shared fixtures and hooks (`tests/fixtures.py`) for every test folder: tests/ and benchmarks/tests/."""

pytest_plugins = ["tests.fixtures"]
