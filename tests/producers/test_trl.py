"""TRL's own `GRPOTrainer` (the pinned `trl`, the `trl` extra) trains through Rollout Streams: `TrlRollouts` as its
`rollout_func`, a real redis-server, `rollouts manager` and two torch worker processes, as a user runs them.

The fleet (manager + workers `w0`, `w1`) is shared by this module's tests, which run in one xdist group: starting
torch workers takes ~10 s each on 2 cores. Each test reads the namespace's version as it finds it, so any order works;
the kill test kills `w1`, and a test after it runs on `w0` alone. `trl` is imported in the tests, not at collection
(~10 s: it imports vLLM), and while the workers start.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import torch

from pipeline.local import RedisServer
from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from pipeline.wire import GENERATORS, TRAINER, Keys
from producers.client import RolloutClient
from producers.integrations.trl import REQUIRED_KEYS, TESTED_TRL, TrlRollouts
from tests.fixtures import FAST, holds_work, wait_until

pytestmark = pytest.mark.xdist_group("trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
WORKERS = ("w0", "w1")
ATOL = 1e-4
"""Logprobs against a forward pass of the published weights: the torch engine's
(tests/consumers/test_torch_engine.py)."""


@dataclass
class Fleet:
    url: str
    ns: str
    model_dir: Path
    processes: dict[str, subprocess.Popen[bytes]]

    def client(self) -> RolloutClient:
        return RolloutClient(self.url, self.ns)

    def live(self) -> list[str]:
        return [name for name in WORKERS if self.processes[name].poll() is None]


@pytest.fixture(scope="module")
def fleet(
    installed_redis: RedisServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """`rollouts manager` and two `rollouts worker --engine torch` on a namespace of this module; stopped by PID.

    `--max-inflight 4`: a worker holds one group (n=4) at a time, so each holds work for most of a step's generation
    (the kill test needs one caught holding work)."""
    logs = tmp_path_factory.mktemp("trl-fleet")
    ns = "trl-" + os.urandom(4).hex()
    url = installed_redis.url
    processes = {"manager": start_command("manager", "--redis", url, "--ns", ns, log_file=logs / "manager.log")}
    try:
        for name in WORKERS:
            flags = ("--engine", "torch", "--num-threads", "1", "--max-inflight", "4", *FAST)
            processes[name] = start_worker(url, ns, tiny_model_dir, name, *flags, log_file=logs / f"{name}.log")
        importlib.import_module("trl")  # while the workers start
        client = redis.Redis.from_url(url)
        for name in WORKERS:
            try:
                wait_for_worker(client, ns, name, processes[name], timeout_s=240)
            except Exception:
                print((logs / f"{name}.log").read_text())
                raise
        client.close()
        yield Fleet(url, ns, tiny_model_dir, processes)
    finally:
        stop_processes(list(processes.values()))


def example() -> Any:
    """`examples/trl_grpo.py` as a module (its dataset and reward function are what the tests train on)."""
    if "trl_grpo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("trl_grpo", EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["trl_grpo"] = module
        spec.loader.exec_module(module)
    return sys.modules["trl_grpo"]


@dataclass
class Recorder:
    """TRL's `rollout_func`: `TrlRollouts` itself, and a copy of the trainer's weights at each call, by the policy
    version they are (the last published at that call), to check the logprobs against."""

    rollouts: TrlRollouts
    outputs: list[dict[str, list[Any]]] = field(default_factory=list)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    trl_prompt_ids: list[list[list[int]]] = field(default_factory=list)
    """The prompts' token ids as TRL's own generation path makes them (`GRPOTrainer._tokenize_prompts`)."""

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        self.trl_prompt_ids.append([list(ids) for ids in trainer._tokenize_prompts(copy.deepcopy(prompts))[0]])
        out = self.rollouts(prompts, trainer)
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        self.weights[self.rollouts.calls[-1].trainer_version] = {k: v.detach().clone() for k, v in state.items()}
        self.outputs.append(out)
        return out


def build_trainer(
    model_dir: Path, tmp_path: Path, rollout_func: Any, steps: int = 6, train_dataset: Any = None, **overrides: Any
) -> Any:
    """`trl.GRPOTrainer` on the example's task: 2 groups of 4 a step, 16 tokens, the example's reward; `overrides` go
    to its `GRPOConfig`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    task = example()
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps, learning_rate=1e-3, seed=0,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    eval_dataset = task.letters_dataset(2, seed=1) if overrides.get("eval_strategy") else None
    return GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=task.letter_share, args=GRPOConfig(**(settings | overrides)),
        train_dataset=task.letters_dataset(8 * steps, seed=0) if train_dataset is None else train_dataset,
        eval_dataset=eval_dataset, processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_func=rollout_func,
    )  # fmt: skip


def grpo(
    fleet: Fleet,
    tmp_path: Path,
    rollouts: TrlRollouts,
    steps: int,
    max_tokens: int = 16,
    eval_steps: int = 0,
    chat: bool = True,
) -> Any:
    """Train `build_trainer`'s GRPO through `rollouts` (recorded), with an evaluation on 2 prompts every `eval_steps`
    (0: none), on conversations or (`chat=False`) text prompts; returns the trainer."""
    evaluation: dict[str, Any] = {}
    if eval_steps:
        evaluation = {"eval_strategy": "steps", "eval_steps": eval_steps, "per_device_eval_batch_size": 8}
    data = example().letters_dataset(8 * steps, seed=0, chat=chat)
    trainer = build_trainer(
        fleet.model_dir, tmp_path, Recorder(rollouts), steps, data, max_completion_length=max_tokens, **evaluation
    )
    trainer.train()
    return trainer


def check_logprobs(fleet: Fleet, recorder: Recorder) -> int:
    """The prompts are tokenized as TRL does, and every returned logprob equals a plain forward pass, over the whole
    prefix, of the weights published as its token's version (a sample continued after a sync was recomputed under the
    new weights); returns the rows checked."""
    from transformers import AutoModelForCausalLM

    models: dict[int, Any] = {}
    rows = 0
    for out, trl_prompt_ids in zip(recorder.outputs, recorder.trl_prompt_ids, strict=True):
        assert out["prompt_ids"] == trl_prompt_ids, "the prompts tokenized as TRL tokenizes them"
        for prompt, tokens, logprobs, versions in zip(
            out["prompt_ids"], out["completion_ids"], out["logprobs"], out["rollout_token_versions"], strict=True
        ):
            expected = np.zeros(len(tokens))
            for version in set(versions):
                if version not in models:
                    models[version] = AutoModelForCausalLM.from_pretrained(fleet.model_dir, dtype=torch.float32).eval()
                    models[version].load_state_dict(recorder.weights[version])
                with torch.inference_mode():
                    logits = models[version](torch.tensor([prompt + tokens])).logits[0].float()
                rows_of = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1], dim=-1)
                chosen = rows_of[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
                mine = np.array(versions) == version
                expected[mine] = chosen[mine]
            np.testing.assert_allclose(np.array(logprobs), expected, rtol=0, atol=ATOL)
            rows += 1
    return rows


def check_namespace_is_clean(fleet: Fleet) -> None:
    """Nothing of the run is left pending: every prompt was generated and acked, every rollout read and acked."""
    r = fleet.client().streams.redis
    keys = Keys(fleet.ns)
    assert r.xpending(keys.prompts, GENERATORS)["pending"] == 0
    assert r.xpending(keys.rollouts, TRAINER)["pending"] == 0
    assert r.xlen(keys.dead) == 0, "no dead letters"


def test_each_step_trains_on_rollouts_of_its_own_weights_published_once_a_step(
    fleet: Fleet, tmp_path: Path, one_thread: None
) -> None:
    """On-policy (the default): 6 steps, an evaluation after steps 3 and 6 (global_step 3 and 6)."""
    steps = 6
    rollouts = TrlRollouts(fleet.client(), ack_timeout_s=30)
    start_version = fleet.client().admission_usage().version
    trainer = grpo(fleet, tmp_path, rollouts, steps, eval_steps=3)
    train = [c for c in rollouts.calls if c.mode == "train"]
    evals = [c for c in rollouts.calls if c.mode == "eval"]
    assert [c.step for c in train] == list(range(steps)) and trainer.state.global_step == steps
    assert [c.step for c in evals] == [3, 6]

    # Each step trains on rollouts of the weights it holds, every token: on-policy, a version a step.
    first = start_version + (start_version != 0)  # a namespace past version 0: the first call publishes
    assert [c.trainer_version for c in train] == [first + s for s in range(steps)]
    assert [c.trainer_version for c in evals] == [first + 3, first + 6], "an evaluation of the weights of its step"
    assert all(set(c.versions) == set(c.versions_end) == {c.trainer_version} for c in rollouts.calls)
    # One sync per step (step 0's weights are the workers' own on a fresh namespace; steps 3 and 6 are published by
    # the evaluation's call), each acked by every worker, none evicted.
    assert [s.step for s in rollouts.syncs] == list(range(0 if start_version else 1, steps + 1))
    for sync in rollouts.syncs:
        assert sorted(sync.acked) == fleet.live() and sync.evicted == [] and sync.gone == [], sync
    # Every rollout delivered once: each step's 2 groups of 4 and each evaluation's; no duplicate, nothing dropped.
    ids = [i for c in rollouts.calls for i in c.rollout_ids]
    assert len(ids) == len(set(ids)) == (steps + 2) * 2 * 4
    assert rollouts.client.stats["duplicates"] == 0 and rollouts.client.stats["dead"] == 0
    groups = (steps + 2) * 2
    assert rollouts.stats == {"groups": groups, "look_ahead_hits": 0, "look_ahead_misses": 0, "dropped_groups": 0}
    # The logprobs TRL got are those of the published weights, token by token.
    recorder: Recorder = trainer.rollout_func
    assert check_logprobs(fleet, recorder) == (steps + 2) * 2 * 4
    # TRL trained on what we returned, and logged what Rollout Streams did.
    logged = [h for h in trainer.state.log_history if "rollout_streams/policy_version" in h]
    assert [h["rollout_streams/policy_version"] for h in logged] == [c.trainer_version for c in train]
    assert all(h["rollout_streams/staleness_max"] == 0 for h in logged)
    check_namespace_is_clean(fleet)


def test_with_look_ahead_the_next_batch_is_generated_while_the_trainer_steps_one_version_old(
    fleet: Fleet, tmp_path: Path, one_thread: None
) -> None:
    """6 steps with `look_ahead`, an evaluation after steps 3 and 6: the evaluation's call publishes that step's
    weights while the look-ahead batch may still be generating (its samples may then be of two versions)."""
    steps = 6
    rollouts = TrlRollouts(fleet.client(), look_ahead=True, ack_timeout_s=30)
    trainer = grpo(fleet, tmp_path, rollouts, steps, eval_steps=3)
    train = [c for c in rollouts.calls if c.mode == "train"]
    evals = [c for c in rollouts.calls if c.mode == "eval"]
    assert [c.look_ahead for c in train] == ["first"] + ["hit"] * (steps - 1), "TRL's next batch predicted each time"
    assert [c.step for c in evals] == [3, 6] and all(c.look_ahead == "off" for c in evals)
    # Step s >= 1 trains on the batch submitted at step s - 1, generated by step s - 1's weights: one version old, each
    # sample of one version (the sync waits until the batch is in) unless an evaluation published under it.
    assert set(train[0].versions) == set(train[0].versions_end) == {train[0].trainer_version}
    for before, call in itertools.pairwise(train):
        assert call.trainer_version == before.trainer_version + 1
        if call.step == 3:  # after the evaluation's publish: tokens of version s - 1, then perhaps of s
            assert min(call.versions) >= before.trainer_version and max(call.versions_end) <= call.trainer_version
        else:
            assert set(call.versions) == set(call.versions_end) == {before.trainer_version}, "one version old"
    assert [s.step for s in rollouts.syncs][-steps:] == list(range(1, steps + 1)), "one sync a step"
    assert all(s.evicted == [] and sorted(s.acked) == fleet.live() for s in rollouts.syncs)
    ids = [i for c in rollouts.calls for i in c.rollout_ids]
    assert len(ids) == len(set(ids)) == (steps + 2) * 2 * 4, "every rollout trained on (or evaluated) once"
    # The batch predicted after the last step was read and dropped at the end of train(): nothing left pending.
    assert rollouts.stats["dropped_groups"] == 2 and rollouts.client.stats["duplicates"] == 0
    recorder: Recorder = trainer.rollout_func
    assert check_logprobs(fleet, recorder) == (steps + 2) * 2 * 4
    logged = [h for h in trainer.state.log_history if "rollout_streams/wait_s" in h]
    staleness = [h["rollout_streams/staleness_mean"] for h in logged]
    assert staleness[0] == 0.0 and all(x == 1.0 for s, x in enumerate(staleness) if s not in (0, 3)), staleness
    assert 0.0 <= staleness[3] <= 1.0
    check_namespace_is_clean(fleet)


def test_look_ahead_stops_where_trls_batches_cannot_be_predicted_and_generates_on_demand(
    fleet: Fleet, tmp_path: Path, one_thread: None
) -> None:
    """Prompts that change on every read of the dataset (numbered reads, as a random augmentation would make them):
    the batch TRL asks for is not in its sampler's order as read again, so look-ahead stops at the first call, with a
    warning, and every batch is generated on demand, on-policy; nothing predicted, nothing dropped."""
    reads = itertools.count()

    def numbered(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """One number a read: a dataloader batch is one read (a group's copies stay equal), a prediction reads one
        item at a time."""
        read = next(reads)
        said = [[{**m[0], "content": f"{m[0]['content']} (read {read})"}] for m in batch["prompt"]]
        return {"prompt": said, "letter": batch["letter"]}

    data = example().letters_dataset(8 * 3, seed=0)
    data.set_transform(numbered)
    rollouts = TrlRollouts(fleet.client(), look_ahead=True, ack_timeout_s=30)
    trainer = build_trainer(fleet.model_dir, tmp_path, Recorder(rollouts), 3, data)
    trainer.train()
    calls = rollouts.calls
    assert [c.look_ahead for c in calls] == ["first", "off", "off"] and rollouts.look_ahead is False
    assert all(set(c.versions) == {c.trainer_version} for c in calls), "on demand: on-policy"
    assert rollouts.stats == {"groups": 6, "look_ahead_hits": 0, "look_ahead_misses": 0, "dropped_groups": 0}
    ids = [i for c in calls for i in c.rollout_ids]
    assert len(ids) == len(set(ids)) == 3 * 2 * 4 and rollouts.client.stats["duplicates"] == 0
    assert check_logprobs(fleet, trainer.rollout_func) == 3 * 2 * 4
    check_namespace_is_clean(fleet)


def test_a_worker_killed_mid_step_loses_nothing_and_the_step_completes_once(
    fleet: Fleet, tmp_path: Path, one_thread: None
) -> None:
    """`kill -9` of `w1` while it holds a group of a step; `w0` serves on, claims that group once it has been idle
    past `--claim-idle-ms`, and the step gets every group once (the regenerated group has the same rollout ids).

    The moment is pinned with SIGSTOP: `w1` is frozen as soon as it is seen holding work, the hold is read while it
    cannot publish, and then it is killed (if it had just finished, it is let go and caught at its next group)."""
    if fleet.live() != list(WORKERS):
        pytest.skip("needs both workers alive")  # never in this file's order: only when this test is re-run alone
    steps, doomed = 5, fleet.processes["w1"]
    client = fleet.client()
    rollouts = TrlRollouts(fleet.client(), ack_timeout_s=30)
    held: list[int] = []

    def kill_when_w1_holds_work() -> None:
        wait_until(lambda: len(rollouts.calls) >= 1, 120, "the first step")  # then mid-step, any step after it
        while not held:
            wait_until(holds_work(client, "w1"), 120, "w1 to hold a group of a step")
            os.kill(doomed.pid, signal.SIGSTOP)
            pending = client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)
            held.extend(c["pending"] for c in pending["consumers"] if c["name"] == b"w1" and c["pending"])
            if not held:
                os.kill(doomed.pid, signal.SIGCONT)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait()

    killer = threading.Thread(target=kill_when_w1_holds_work, daemon=True)
    killer.start()
    trainer = grpo(fleet, tmp_path, rollouts, steps, max_tokens=32, chat=False)  # text prompts, tokenized as TRL does
    killer.join(timeout=5)
    assert doomed.returncode == -signal.SIGKILL and held and held[0] > 0, "killed holding work"
    assert not killer.is_alive()
    calls = rollouts.calls
    assert [c.step for c in calls] == list(range(steps)) and trainer.state.global_step == steps
    assert all(set(c.versions) == {c.trainer_version} for c in calls), "on-policy still"
    ids = [i for c in calls for i in c.rollout_ids]
    assert len(ids) == len(set(ids)) == steps * 2 * 4, "every group delivered once, the killed worker's too"
    assert rollouts.stats["groups"] == steps * 2 and rollouts.client.stats["dead"] == 0
    assert all("w0" in s.acked and set(s.evicted) <= {"w1"} for s in rollouts.syncs), rollouts.syncs
    recorder: Recorder = trainer.rollout_func
    assert check_logprobs(fleet, recorder) == steps * 2 * 4
    check_namespace_is_clean(fleet)


def test_trl_is_the_pinned_release_and_its_rollout_func_contract_is_the_one_we_serve() -> None:
    """A guard against version skew: `rollout_func` is experimental in TRL, so a new release must fail here first."""
    import trl
    from trl import GRPOTrainer

    assert trl.__version__ == TESTED_TRL, f"CI pins trl=={TESTED_TRL} (pyproject's `trl` extra)"
    source = inspect.getsource(GRPOTrainer._generate)
    found = re.search(r"required_keys = (\{[^}]*\})", source)
    assert found and ast.literal_eval(found.group(1)) == set(REQUIRED_KEYS), "the keys TRL requires of a rollout_func"
    assert "output = self.rollout_func(prompts, self)" in source


def test_look_ahead_predicts_the_batches_trls_own_dataloader_yields(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The look-ahead's plan (a second sampler, same seed) against the trainer's real dataloader, over two epochs,
    with several micro-steps per generation and iterations (TRL generates on every 4th batch here)."""
    from producers.integrations.trl import groups_of, sampler_plan

    task = example()
    trainer = build_trainer(
        tiny_model_dir, tmp_path, TrlRollouts.__call__, train_dataset=task.letters_dataset(12, seed=3),
        per_device_train_batch_size=4, num_generations=2, steps_per_generation=2, num_iterations=2,
    )  # fmt: skip
    loader = trainer.get_train_dataloader()
    generate_every = 2 * 2
    generated = []
    for _ in range(2):  # epochs: the sampler draws a new order each
        batches = list(loader)
        assert len(batches) == 3 * generate_every, "12 prompts, 4 a generation batch, each batch yielded 4 times"
        generated += [groups_of([row["prompt"] for row in batches[i]], 2) for i in range(0, len(batches), 4)]
    plan = sampler_plan(trainer)
    assert [next(plan.batches) for _ in generated] == generated
    assert generated[:3] != generated[3:], "the second epoch is drawn in another order"


def test_what_the_workers_cannot_do_is_refused_in_one_line(
    installed_redis: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Refused before anything is submitted, each reason named: never a sampling option silently dropped."""
    from producers.client import ParkingBound
    from producers.integrations.trl import groups_of

    url = installed_redis.url
    with pytest.raises(ValueError, match="without max_staleness and batch_size"):
        TrlRollouts(RolloutClient(url, ns, max_staleness=1, batch_size=8))
    with pytest.raises(ValueError, match="without a parking bound"):
        TrlRollouts(RolloutClient(url, ns, park=ParkingBound(1)))
    client = RolloutClient(url, ns)
    rollouts = TrlRollouts(client)
    settings: dict[str, Any] = {"generation_kwargs": {"typical_p": 0.9}}
    trainer = build_trainer(tiny_model_dir, tmp_path, rollouts, **settings)
    with pytest.raises(ValueError) as refused:
        rollouts([[{"role": "user", "content": "write the letter a"}]] * 4, trainer)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("TrlRollouts cannot serve this trainer: ")
    assert "generation_kwargs ['typical_p']: not applied by the workers" in message
    iterable = example().letters_dataset(48, seed=0).to_iterable_dataset()
    streamed = build_trainer(tiny_model_dir, tmp_path, rollouts, train_dataset=iterable)
    with pytest.raises(ValueError, match="look_ahead=True needs a map-style train_dataset"):
        TrlRollouts(client, look_ahead=True)(["p"] * 4, streamed)
    assert client.streams.redis.xlen(client.streams.keys.prompts) == 0, "nothing was submitted"
    with pytest.raises(ValueError, match="not a multiple of num_generations=4"):
        groups_of(["a"] * 6, 4)
    with pytest.raises(ValueError, match="not one prompt repeated"):
        groups_of(["a", "a", "b", "a"], 2)


def test_trls_sampling_settings_go_on_each_prompt_the_workers_sample_with(
    installed_redis: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`top_k`, `min_p` and `repetition_penalty` of the `GRPOConfig` are the workers' knobs now: each group's prompt
    carries them (and `temperature`, `top_p`), where they were refused before."""
    from pipeline.codec import as_entries
    from pipeline.wire import Prompt

    client = RolloutClient(installed_redis.url, ns)
    rollouts = TrlRollouts(client, timeout_s=1.0)
    knobs: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1}
    trainer = build_trainer(tiny_model_dir, tmp_path, rollouts, **knobs)
    with pytest.raises(TimeoutError):  # no worker: the prompts wait on the stream
        rollouts([[{"role": "user", "content": "write the letter a"}]] * 4, trainer)
    [(_, fields)] = as_entries(client.streams.redis.xrange(client.streams.keys.prompts))
    sampling = Prompt.from_fields(fields).sampling
    assert {name: getattr(sampling, name) for name in knobs} == pytest.approx(knobs)
