"""The suite's shared fixtures and hooks (`tests/fixtures.py`) for every test folder: tests/ and benchmarks/tests/;
and the CPU seconds each test costs (`tests/cpu_seconds.py`)."""

pytest_plugins = ["tests.fixtures", "tests.cpu_seconds"]
