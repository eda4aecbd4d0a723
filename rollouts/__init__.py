"""The `rollouts` command: the shell, the package above the four (pipeline, producers, consumers, staleness) and the
one place that composes them; none of them imports it (tests/system/test_layers.py).

`app` holds the typer app, the options the commands share and `main`; each module below holds one group of commands
and registers them on `app` when imported, in the order `rollouts --help` lists them. Other packages (the lab,
`benchmarks/`, a distribution of its own) add theirs, hidden, through the `rollouts.commands` entry points, which `main`
loads only when the command asked for is not one of these.
"""

# The order of the command modules is the order of `rollouts --help`.
# isort: off
from rollouts.app import app, main
from rollouts import quickstart, serve, fleet, queue, recording, scoring, evaluate, gateway, launch, exporter, acl  # noqa: F401

# isort: on

__all__ = ["app", "main"]
