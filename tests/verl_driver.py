"""verl 0.9.1's own machinery driving Rollout Streams (run by tests/producers/test_verl.py in a venv where verl is
installed).

It finds `rollout_streams` in verl's registries (the `verl.plugins` entry point loads producers.integrations.verl when
verl is imported), starts the replica with verl's `LLMServerManager` (standalone: no GPU), generates through verl's
`LLMServerClient` and load balancer, and updates the weights with the checkpoint manager class named in the config,
whose actor worker group is verl's `RayWorkerGroup` of two CPU ranks, each holding the model (rank 0 publishes, rank 1
iterates its share). It prints one JSON line: what the registries hold, the samples before and after the update, and
the update's metrics. The test checks them against the fleet and a forward pass.

Usage: python tests/verl_driver.py '{"gateway": ..., "redis": ..., "ns": ..., "weights_dir": ..., "prompt": [...]}'
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch
import verl
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils.import_utils import load_class_from_fqn
from verl.workers.config import CheckpointEngineConfig
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import get_rollout_replica_class

ROLLOUT_YAML = Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml"
"""verl's rollout defaults, as its trainers compose them (`actor_rollout_ref.rollout`)."""
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
"""What verl's agent loop sends (`AgentLoopManager`: its rollout config's, with `calculate_log_probs`), at a temperature
and top-p where processed logprobs (verl's default `logprobs_mode`) differ from raw ones."""


class Actor(Worker):
    """A trainer rank as verl's engine workers build one: the model, and the checkpoint engine the config names."""

    def __init__(self, weights_dir: str, checkpoint_engine: dict[str, Any]) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=torch.float32)
        config = CheckpointEngineConfig(**checkpoint_engine)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            is_master=self.rank == 0,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            **config.engine_kwargs.get(config.backend, {}),
        )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        per_tensor = ((name, tensor.detach()) for name, tensor in self.model.state_dict().items())
        return await self.checkpoint_engine.send_weights(per_tensor, global_steps=global_steps) or {}


async def sample(client: Any, prompt: list[int], tag: str, n: int) -> list[dict[str, Any]]:
    outputs = await asyncio.gather(
        *[client.generate(f"{tag}-{i}", prompt_ids=prompt, sampling_params=dict(SAMPLING, max_tokens=12))
          for i in range(n)]
    )  # fmt: skip
    return [output.model_dump() for output in outputs]


STARTED = time.monotonic()


def say(what: str) -> None:
    """A step on stderr (the test's log), at its second since the driver started: where the time went."""
    print(f"[{time.monotonic() - STARTED:6.1f} s] {what}", file=sys.stderr, flush=True)


def main(settings: dict[str, Any]) -> dict[str, Any]:
    found = {
        "replica": get_rollout_replica_class("rollout_streams").__qualname__,
        "checkpoint_engine": CheckpointEngineRegistry.get("rollout_streams").__qualname__,
    }
    checkpoint_engine = {
        "backend": "rollout_streams",
        "update_weights_bucket_megabytes": 1,
        "engine_kwargs": {"rollout_streams": {"redis": settings["redis"], "ns": settings["ns"]}},
    }
    overrides = {  # the lines a verl user sets, over verl's own rollout.yaml
        "name": "rollout_streams",
        "nnodes": 1,
        "n_gpus_per_node": 1,
        "tensor_model_parallel_size": 1,
        "prompt_length": 16,
        "response_length": 12,
        "calculate_log_probs": True,
        "logprobs_mode": "processed_logprobs",
        "engine_kwargs": {"rollout_streams": {"gateway": settings["gateway"]}},
        "checkpoint_engine": checkpoint_engine,
        "checkpoint_manager_class": "producers.integrations.verl.RolloutStreamsCheckpointManager",
    }
    rollout = OmegaConf.merge(OmegaConf.load(ROLLOUT_YAML), overrides)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": rollout, "model": {}}})
    say("starting a local Ray cluster")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        say("launching the replica with verl's LLMServerManager")
        servers = LLMServerManager.create(config)  # verl resolves `rollout.name` in its registry and launches it
        client = servers.get_client()
        found["server_addresses"] = servers.get_addresses()
        say("generating through verl's LLMServerClient")
        before = asyncio.run(sample(client, settings["prompt"], "before", 3))

        say("starting verl's actor worker group")
        actor_group = RayWorkerGroup(
            resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1),  # one CPU a rank
            ray_cls_with_init=RayClassWithInitArgs(
                cls=ray.remote(Actor), weights_dir=settings["weights_dir"], checkpoint_engine=checkpoint_engine
            ),
            device_name="cpu",
        )
        manager_class = load_class_from_fqn(config.actor_rollout_ref.rollout.checkpoint_manager_class)
        checkpoints = manager_class(
            config=CheckpointEngineConfig(**checkpoint_engine), actor_wg=actor_group, replicas=servers.get_replicas()
        )
        say("updating the weights")
        checkpoints.sleep_replicas()  # as verl's trainer does before its first update
        metrics = checkpoints.update_weights(global_steps=1)
        checkpoints.wake_up_replicas()
        say("generating with the new weights")
        after = asyncio.run(sample(client, settings["prompt"], "after", 3))
        refused = ""
        try:
            asyncio.run(client.generate("refused", prompt_ids=settings["prompt"],
                                        sampling_params=dict(SAMPLING, ignore_eos=True, max_tokens=4)))  # fmt: skip
        except Exception as exc:  # a Ray task error wrapping the server's GatewayRefused
            refused = str(exc)
        return {"found": found, "before": before, "metrics": metrics, "after": after, "refused": refused[-2000:]}
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
