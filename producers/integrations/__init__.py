"""Rollout Streams behind the trainers people already use.

Each module adapts one framework's generation hook to `producers.client.RolloutClient` and imports that framework
only when it is used, so that `import producers` never needs it: `producers.integrations.trl` (TRL's
`GRPOTrainer(rollout_func=...)`, docs/guide/trl.md), `producers.integrations.verl` (verl's rollout replica and
checkpoint engine registries, loaded by verl's `verl.plugins` entry point: docs/guide/verl.md) and
`producers.integrations.verifiers` (a verifiers environment's episodes, through its own train client, published as
whole groups: docs/guide/verifiers.md).
"""
