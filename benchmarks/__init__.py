"""The lab: benchmarks, soaks, fault runs and probes of Rollout Streams.

It imports the product (pipeline, producers, consumers, staleness and the shell, rollouts) and is never imported by
it, nor shipped in its wheel: it is a distribution of its own (`benchmarks/pyproject.toml`), installed from a
checkout. Its commands run as `rollouts-bench COMMAND` (`benchmarks.cli`), as `python -m benchmarks COMMAND` from a
checkout with nothing installed, and as hidden commands of `rollouts` through the `rollouts.commands` entry point
(loaded only for them); its probes are scripts under `benchmarks/probes/`, the device machines' runs under
`benchmarks/device/`, and stored results under `benchmarks/results/`.
"""

PROGRAM = __name__
"""The lab's commands as a program, `python -m benchmarks`: how a run starts the processes that are commands of its
own (`chaos-trainer`, `scale-ping`, `scale-fleet`), so that they need no installed entry point."""
