"""verifiers 0.4.0's own train client against `rollouts gateway`, through `producers.integrations.verifiers`: run by
tests/producers/test_verifiers.py in a venv of its own (verifiers pins openai<3; the test says what is installed),
with this checkout on `sys.path` for the product's modules.

It runs, in this process as `vf-eval` runs them (`Env.serving`, `Env.run_slot`), one group of a single-turn
`SingleAgentEnv` and one of the built-in `user-sim` environment (an assistant and a simulated user, both the tiny
policy), both agents on verifiers' tool-less `null` harness and its `subprocess` runtime, every model call through
verifiers' `TrainClient` (renderers' client: `POST /inference/v1/generate`). `VerifiersRollouts` publishes each group
to the namespace; the test reads them with `RolloutClient`. It prints one JSON object a line: each group's report and
every trace as verifiers made it (branches with token ids, mask, logprobs, messages and their nodes' sizes), and
`started` once an assistant of the `user-sim` group has its first reply (the test publishes new weights then).

Nothing is fetched at run time: the chat program verifiers runs for an agent (a PEP 723 script it would `uv sync`
into an environment of its own, from the network) runs with this venv's Python, which has every package the script
declares (`SubprocessRuntime.prepare_uv_script` is replaced for that, and for nothing else); the tokenizer is the tiny
model's folder (`renderer_model`), and `HF_HUB_OFFLINE` is set. The taskset is this module (`verifiers` imports a
taskset by its id: `verifiers_driver`, found on `sys.path`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.envs.user_sim.env import UserSimEnv, UserSimEnvConfig
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

PROMPTS = ["say hello", "count to three"]
PERSONA = "You are a user. Ask the assistant about: {scenario}. Say {done} when done."
"""user-sim's persona, short: its default one is ~480 tokens, most of the tiny model's 512-token context."""


class EchoTask(vf.Task):
    @vf.reward
    async def replied(self, trace: Any) -> float:
        """1 when the last reply has any text (the tiny model is random: the reward is the environment's to give)."""
        return float(bool(trace.last_reply))

    @vf.metric
    async def reply_chars(self, trace: Any) -> float:
        return float(len(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask]):
    def load(self) -> Any:
        for i, prompt in enumerate(PROMPTS):
            yield EchoTask(vf.TaskData(id=f"echo-{i}", prompt=prompt))


__all__ = ["EchoTaskset"]


async def _venv_python_script(self: Any, script: str | bytes, env: Any = None, *, activate: bool = True) -> list[str]:
    """`SubprocessRuntime.prepare_uv_script`, without uv: the script as a file in the runtime's workdir, run with this
    venv's Python."""
    path = Path(self.workdir) / "vf-program.py"
    path.write_bytes(script.encode() if isinstance(script, str) else script)
    return [sys.executable, str(path)]


def trace_record(trace: Any) -> dict[str, Any]:
    return {
        "id": trace.id,
        "agent": trace.agent.name,
        "trainable": trace.agent.trainable,
        "ok": trace.ok,
        "stop": trace.stop_condition,
        "errors": [f"{e.type}: {e.message}" for e in trace.errors],
        "reward": trace.reward,
        "turns": trace.num_turns,
        "branches": [
            {
                "trainable": b.trainable,
                "token_ids": b.token_ids,
                "sampled_mask": b.sampled_mask,
                "logprobs": b.logprobs,
                "messages": [m.model_dump(mode="json", exclude_none=True) for m in b.messages],
                "nodes": [{"tokens": len(n.token_ids), "sampled": sum(n.mask)} for n in b.nodes],
            }
            for b in trace.branches
        ],
    }


async def run_group(env: Any, config: dict[str, Any], client: Any, say_started: bool = False) -> dict[str, Any]:
    """One group of the taskset's first task. `say_started` (user-sim): says `started` once an assistant's first reply
    came back, which is when the gateway has answered more sessions than the group has simulated users (they open)."""
    from producers.integrations.verifiers import VerifiersRollouts
    from tests.engine_loop import wait_until_async

    task = next(iter(env.taskset))
    async with VerifiersRollouts(
        client,
        env,
        gateway=config["gateway"],
        model="tiny",
        renderer_model=config["model_dir"],
        sampling={"max_tokens": config["max_tokens"], "temperature": 1.0},
    ) as source:
        group = asyncio.create_task(source.run_group(task, config["group_size"]))
        if say_started:  # the driver's own bound, 300 s; the test's subprocess timeout is longer
            await wait_until_async(lambda: group.done() or len(source.recorder.replies) > config["group_size"], 300)
            say(event="started")
        report = await group
    return {
        "prompt_id": report.prompt_id,
        "rollout_ids": report.rollout_ids,
        "rewards": report.rewards,
        "published": report.published,
        "failed": report.failed,
        "untrainable": report.untrainable,
        "released": report.released,
        "wall_s": report.wall_s,
        "episodes": [
            {"ok": e.ok, "errors": [x.message for x in e.errors], "traces": [trace_record(t) for t in e.traces]}
            for e in report.episodes
        ],
    }


async def main(config: dict[str, Any]) -> None:
    from producers.client import RolloutClient

    agent = {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}
    single = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": "verifiers_driver"}, agent=agent))
    user_sim = UserSimEnv(
        UserSimEnvConfig(
            taskset={"id": "verifiers_driver"},
            assistant=agent,
            user={**agent, "max_turns": config["user_turns"]},
            persona=PERSONA,
        )
    )
    client = RolloutClient(config["redis"], config["ns"])
    say(event="single", **await run_group(single, config, client))
    say(event="user_sim", **await run_group(user_sim, config, client, say_started=True))


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the product's packages, from this checkout
    sys.path.append(str(Path(__file__).resolve().parent))  # this module, as the taskset `verifiers_driver`
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    SubprocessRuntime.prepare_uv_script = _venv_python_script
    asyncio.run(main(json.loads(sys.argv[1])))
