"""The lab: benchmarks, soaks, fault runs and probes of Rollout Streams.

It imports the product (pipeline, producers, consumers, staleness) and is never imported by it. Its commands run as
`rollouts-bench COMMAND` (`benchmarks.cli`), and as hidden commands of `rollouts` through the `rollouts.commands`
entry point; its probes are scripts under `benchmarks/probes/`, the device machines' runs under `benchmarks/device/`,
and stored results under `benchmarks/results/`.
"""
