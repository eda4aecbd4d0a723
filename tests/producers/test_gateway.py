"""The OpenAI-compatible gateway, driven by the official `openai` client against `rollouts gateway` processes and
real workers: token-exact trajectories, sticky sessions shared by replicas, a worker killed mid-session, weight
syncs mid-turn, calls during a pause, and bad requests answered in OpenAI's error shape with nothing queued."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
from transformers import AutoTokenizer

from pipeline.codec import as_text
from pipeline.local import RedisServer
from pipeline.streams import Streams
from pipeline.wire import Keys, PauseMode
from producers.client import Batch, RolloutClient
from staleness.manager import Manager
from staleness.weights import open_transport
from tests.fixtures import StartGateway, StartWorker, openai_client, wait_until
from tests.reference import forward_logprobs

SLOW = ("--engine", "synthetic", "--engine-args", '{"steps_per_s": 20}')
"""A worker that makes 20 tokens a second: a turn of 40 tokens is in flight for 2 s."""


def turn(client: openai.OpenAI, session: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]  # plain dicts; openai types messages as TypedDicts
        extra_headers={"X-Session-ID": session},
        extra_body={"return_token_ids": True},
        **kwargs,
    )


def finish(base: str, session: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{base}/sessions/{session}/finish", json=body, timeout=30)


def session_worker(redis_url: str, ns: str, session: str) -> str:
    client = redis.Redis.from_url(redis_url)
    try:
        return as_text(client.hget(Keys(ns).session(session), "worker") or b"")
    finally:
        client.close()


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of the gateway's Prometheus metrics, scraped over HTTP."""
    text = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}{labels} in the gateway's metrics")


def test_a_three_turn_conversation_with_a_tool_gives_a_token_exact_trajectory(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
) -> None:
    """The trajectory is the chat template's rendering, token for token, with the model's own tokens where it wrote
    them (never re-tokenized), and the mask covers exactly those; their logprobs match a forward pass over it all."""
    workers("w1")
    base = gateways("gw")
    client = openai_client(base)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 12 + 30?"},
    ]
    follow_ups = [
        {"role": "tool", "content": "calculator: 42", "tool_call_id": "c1"},
        {"role": "user", "content": "Sure?"},
    ]
    answers = []
    for k in range(3):
        answer = turn(client, "chat-1", messages, max_tokens=12, seed=k, logprobs=True)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        if k < 2:
            messages.append(follow_ups[k])
    # An agent that edits the history cannot extend the session: a clear 400, and the session goes on.
    edited = [
        *messages[:2],
        {"role": "assistant", "content": "something else"},
        *messages[3:],
        {"role": "user", "content": "?"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        turn(client, "chat-1", edited, max_tokens=4)
    assert refused.value.body["code"] == "session_history_mismatch"  # type: ignore[index]  # the error's body: object in openai's types, our JSON dict

    done = finish(base, "chat-1", reward=0.5).json()
    assert (done["turns"], done["sample"], done["group_size"]) == (3, 0, 1)
    assert finish(base, "chat-1", reward=0.5).json() == done  # a retried finish: the same answer, nothing more
    trainer = RolloutClient(redis_server.url, ns)
    [group] = trainer.collect(1, timeout=30)
    [r] = group.rollouts
    assert trainer.streams.redis.xlen(trainer.streams.keys.rollouts) == 1
    assert (r.reward, r.n, r.meta["turns"], r.meta["workers"]) == (0.5, 1, 3, ["w1", "w1", "w1"])

    # The first prompt is the template's; each turn saw exactly the trajectory before its reply.
    first = tok.apply_chat_template(messages[:2], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.prompt_tokens.tolist() == list(first)
    everything = np.concatenate([r.prompt_tokens, r.tokens]).tolist()
    assert r.mask is not None and len(r.mask) == 3
    for answer, (start, end) in zip(answers, r.mask, strict=True):
        choice = answer.choices[0]
        assert r.tokens[start:end].tolist() == choice.model_extra["token_ids"]  # the model's own tokens
        assert answer.model_extra["prompt_token_ids"] == everything[: len(r.prompt_tokens) + start]
        sent = np.array([c.logprob for c in choice.logprobs.content], np.float32)
        np.testing.assert_allclose(r.logprobs[start:end], sent, atol=1e-6)
    # The tokens between replies are the template's text, tokenized as the tokenizer does, and not trained on.
    gaps = [(a[1], b[0]) for a, b in zip(r.mask, r.mask[1:], strict=False)]
    for start, end in gaps:
        gap = r.tokens[start:end].tolist()
        assert gap and tok.encode(tok.decode(gap), add_special_tokens=False) == gap
        assert not r.logprobs[start:end].any()
    # Decoded, it all reads as the template's rendering of the conversation with the replies the model wrote.
    written = [tok.decode(r.tokens[s:e], skip_special_tokens=False) for s, e in r.mask]
    shown = [dict(m) for m in messages]
    for m, text, answer in zip([m for m in shown if m["role"] == "assistant"], written, answers, strict=True):
        stopped = answer.choices[0].finish_reason == "stop"
        assert isinstance(text, str)  # one sequence decodes to one string
        m["content"] = text.removesuffix(tok.eos_token) if stopped else text
    rendered = tok.apply_chat_template(shown, tokenize=False)
    got = tok.decode(everything, skip_special_tokens=False)
    assert isinstance(rendered, str) and isinstance(got, str)  # not tokenized, one sequence: text
    assert rendered.startswith(got) and rendered[len(got) :] in ("", tok.eos_token)
    # The model's tokens, and only they, are trained on; their logprobs are those of one forward pass over it all.
    arrays = Batch([group]).to_arrays()
    p = len(r.prompt_tokens)
    expected_mask = np.zeros(len(everything), np.int64)
    for start, end in r.mask:
        expected_mask[p + start : p + end] = 1
    assert arrays["loss_mask"][0, : len(everything)].tolist() == expected_mask.tolist()
    reference = forward_logprobs(tiny_model_dir, r.prompt_tokens.tolist(), r.tokens.tolist())
    written_mask = r.model_token_mask()
    np.testing.assert_allclose(r.logprobs[written_mask], reference[written_mask], atol=2e-4)

    # Streaming gives the same reply as a plain call with the same seed; completions take token ids.
    ask = [{"role": "user", "content": "Count to three."}]
    plain = client.chat.completions.create(model="tiny", messages=ask, max_tokens=8, seed=7)
    chunks = client.chat.completions.create(model="tiny", messages=ask, max_tokens=8, seed=7, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt=first, max_tokens=5, n=2, seed=3)
    assert len(completion.choices) == 2 and completion.usage.completion_tokens <= 10
    # A stop string cuts the text before it, as OpenAI does (same seed: the same sample, now cut).
    text = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, seed=11).choices[0].text
    assert len(text) >= 6, text
    stop = text[3:5]
    cut = client.completions.create(model="tiny", prompt="The cat", max_tokens=24, seed=11, stop=[stop]).choices[0]
    assert cut.text == text[: text.find(stop)] and cut.finish_reason == "stop"


def test_sessions_stick_to_the_least_loaded_worker_and_replicas_share_the_pins(
    redis_server: RedisServer, ns: str, workers: StartWorker, gateways: StartGateway
) -> None:
    """Four sessions start on gateway A and spread 2 + 2 over two workers; their later turns through gateway B go to
    the same workers; finished on B as one group of 4, the trainer gets one group whose every trajectory stayed put."""
    # the routing is tested, not the engine's numbers: they serve sooner
    workers.many(("w1", "--engine", "synthetic"), ("w2", "--engine", "synthetic"))
    a, b = openai_client(gateways("gw-a")), gateways("gw-b")
    sessions = [f"task-7-{k}" for k in range(4)]
    histories: dict[str, list[dict[str, Any]]] = {}
    for sid in sessions:
        histories[sid] = [{"role": "user", "content": f"Say something, {sid}."}]
        reply = turn(a, sid, histories[sid], max_tokens=6).choices[0].message.content
        histories[sid] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    pinned = {sid: session_worker(redis_server.url, ns, sid) for sid in sessions}
    assert sorted(pinned.values()) == ["w1", "w1", "w2", "w2"]
    for sid in sessions:
        for client in (openai_client(b), a):
            reply = turn(client, sid, histories[sid], max_tokens=6).choices[0].message.content
            histories[sid] += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
        assert finish(b, sid, reward=1.0, group="task-7", group_size=4).status_code == 200
    late = turn(a, "task-7-late", [{"role": "user", "content": "Hi."}], max_tokens=2)
    assert late.choices[0].finish_reason in ("stop", "length")
    full = finish(b, "task-7-late", reward=0.0, group="task-7", group_size=4)
    assert full.status_code == 409 and full.json()["error"]["code"] == "group_conflict"
    [group] = RolloutClient(redis_server.url, ns).collect(1, timeout=30)
    assert group.prompt_id == "task-7" and [r.sample for r in group.rollouts] == [0, 1, 2, 3]
    by_session = {r.meta["session"]: r for r in group.rollouts}
    for sid in sessions:
        assert by_session[sid].meta["workers"] == [pinned[sid]] * 3, "a turn left its session's worker"
        assert by_session[sid].meta["turns"] == 3


def test_a_session_whose_worker_is_killed_mid_turn_finishes_on_another(
    redis_server: RedisServer, ns: str, workers: StartWorker, gateways: StartGateway
) -> None:
    """kill -9 of the pinned worker while a turn is in flight: the caller still gets the whole reply (its inbox moved
    back to the shared queue), the session moves to the survivor, and the trajectory loses nothing."""
    procs = dict(zip(("s1", "s2"), workers.many(("s1", *SLOW), ("s2", *SLOW)), strict=True))
    base = gateways("gw")
    client = openai_client(base)
    history: list[dict[str, Any]] = [{"role": "user", "content": "Tell me a long story."}]
    first = turn(client, "story", history, max_tokens=4).choices[0]
    history += [{"role": "assistant", "content": first.message.content}, {"role": "user", "content": "Go on."}]
    victim = session_worker(redis_server.url, ns, "story")
    survivor = ({"s1", "s2"} - {victim}).pop()
    result: dict[str, Any] = {}
    call = threading.Thread(target=lambda: result.update(answer=turn(client, "story", history, max_tokens=40)))
    call.start()
    beat = redis.Redis.from_url(redis_server.url)
    wait_until(lambda: int(beat.hget(Keys(ns).worker(victim), "inflight") or 0) > 0, 30, "the turn to be generating")
    os.kill(procs[victim].pid, signal.SIGKILL)
    call.join(timeout=90)
    assert not call.is_alive(), "the turn never came back"
    second = result["answer"].choices[0]
    assert second.finish_reason == "length" and len(second.model_extra["token_ids"]) == 40
    history += [{"role": "assistant", "content": second.message.content}, {"role": "user", "content": "The end?"}]
    turn(client, "story", history, max_tokens=4)
    assert session_worker(redis_server.url, ns, "story") == survivor
    assert finish(base, "story", reward=1.0).status_code == 200
    [group] = RolloutClient(redis_server.url, ns).collect(1, timeout=30)
    [r] = group.rollouts
    assert r.meta["workers"] == [victim, survivor, survivor]
    assert r.mask is not None and [e - s for s, e in r.mask] == [4, 40, 4]
    beat.close()


@pytest.mark.parametrize(
    "mode",
    [
        "abort",
        "keep",
        pytest.param(
            "inflight",
            marks=pytest.mark.long(
                "a turn kept going in its engine through the sync, as [keep] keeps it; the inflight mode's spans: "
                "tests/staleness/test_weight_sync.py's test_inflight_syncs_mid_generation_reach_every_sample_once_..."
            ),
        ),
    ],
)
def test_a_weight_sync_mid_turn_returns_one_complete_answer_spanning_both_versions(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
    mode: PauseMode,
) -> None:
    workers("s1", *SLOW)
    client = openai_client(gateways("gw"))
    result: dict[str, Any] = {}
    ask = [{"role": "user", "content": "A long answer, please."}]
    # 120 tokens at 20 a second: 6 s in flight, so that the sync lands mid-turn though the test process that publishes
    # it is slow to (under a loaded suite a 3-s turn was over before the sync came).
    call = threading.Thread(target=lambda: result.update(answer=turn(client, "sync", ask, max_tokens=120)))
    call.start()
    trainer = RolloutClient(redis_server.url, ns)
    beat = trainer.streams.redis
    # Half a second in flight (its heartbeat's busy_s) at 20 tokens/s: the turn has tokens of version 0 to keep.
    wait_until(lambda: float(beat.hget(Keys(ns).worker("s1"), "busy_s") or 0) >= 0.5, 30, "the turn to generate")
    assert trainer.publish_weights(tiny_model_dir_v1, transport="redis://", mode=mode) == 1
    call.join(timeout=60)
    answer = result["answer"]
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 120
    spans = choice.model_extra["spans"]
    assert [s[0] for s in spans] == [0, 1] and spans[0][1] == 0 and spans[-1][2] == 120, spans
    assert answer.model_extra["policy_version"] == 0


def test_a_call_during_a_pause_waits_for_the_resume_and_runs_on_the_new_weights(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
) -> None:
    """Nothing is queued while the policy is paused (so no request runs on half-loaded weights); the call then
    runs on the new version. A replica with a short pause timeout answers 503 with the reason instead."""
    workers("w1", "--engine", "synthetic")  # the pause is tested, not the weights: it serves sooner
    patient, impatient = gateways("gw-patient"), gateways("gw-impatient", "--pause-timeout-s", "0.5")
    streams = Streams(redis.Redis.from_url(redis_server.url), ns)
    uri = open_transport("redis://", redis_client=streams.redis, ns=ns).publish(tiny_model_dir_v1, 1)
    release = threading.Event()
    sync = threading.Thread(target=lambda: Manager(streams).sync(1, uri, transfer=lambda *_: release.wait(60)))
    sync.start()
    try:
        wait_until(lambda: streams.redis.hget(streams.keys.state, "paused") == b"1", 30, "the pause")
        queued = streams.redis.xlen(streams.keys.prompts)
        result: dict[str, Any] = {}
        ask = [{"role": "user", "content": "Hello?"}]
        call = threading.Thread(
            target=lambda: result.update(
                answer=openai_client(patient).chat.completions.create(model="tiny", messages=ask, max_tokens=4)
            )
        )
        call.start()
        wait_until(lambda: metric(patient, "rollouts_gateway_waiting_calls", on="resume") == 1, 30, "a call waiting")
        assert streams.redis.xlen(streams.keys.prompts) == queued, "a call was queued during the pause"
        with pytest.raises(openai.APIStatusError) as paused:
            openai_client(impatient).chat.completions.create(model="tiny", messages=ask, max_tokens=4)
        assert paused.value.status_code == 503 and paused.value.body["code"] == "policy_paused"  # type: ignore[index]  # the error's body: object in openai's types, our JSON dict
        assert streams.redis.xlen(streams.keys.prompts) == queued
    finally:
        release.set()
        sync.join(timeout=60)
    call.join(timeout=60)
    answer = result["answer"]
    assert answer.model_extra["policy_version"] == 1 and all(s[0] == 1 for s in answer.choices[0].model_extra["spans"])


def test_bad_requests_get_openai_errors_and_queue_nothing(
    redis_server: RedisServer, ns: str, gateways: StartGateway
) -> None:
    base = gateways("gw", "--max-model-len", "64")
    client = openai_client(base)
    ok = [{"role": "user", "content": "Hi"}]

    def refused(error: type[openai.APIStatusError], code: str | None, **kwargs: Any) -> dict[str, Any]:
        call = {"model": "tiny", "messages": ok, "max_tokens": 4} | kwargs
        headers = call.pop("headers", None)
        with pytest.raises(error) as caught:
            client.chat.completions.create(**call, extra_headers=headers)
        body = caught.value.body
        assert isinstance(body, dict) and body["message"] and body["type"], body
        if code is not None:
            assert body["code"] == code, body
        return body

    refused(openai.NotFoundError, "model_not_found", model="gpt-4")
    refused(openai.BadRequestError, "context_length_exceeded", messages=[{"role": "user", "content": "word " * 80}])
    refused(openai.BadRequestError, "context_length_exceeded", max_tokens=60)
    assert "role" in refused(openai.BadRequestError, None, messages=[{"role": "wizard", "content": "x"}])["message"]
    refused(openai.BadRequestError, None, messages=[])
    refused(openai.BadRequestError, None, messages=[{"role": "user", "content": [{"type": "image_url", "x": 1}]}])
    refused(openai.BadRequestError, None, messages=[{"content": "no role"}])
    refused(openai.BadRequestError, None, temperature=7.0)
    refused(openai.BadRequestError, "invalid_value", top_logprobs=21, logprobs=True)
    refused(openai.BadRequestError, None, stop=[""])
    refused(openai.BadRequestError, None, n=2, headers={"X-Session-ID": "s"})
    refused(openai.BadRequestError, None, headers={"X-Session-ID": "has spaces"})
    refused(openai.BadRequestError, None, messages=[*ok, {"role": "assistant", "content": "prefilled"}])
    refused(openai.APIStatusError, "no_worker")  # valid, but nobody serves this namespace
    raw = httpx.post(f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    missing = finish(base, "never-started", reward=1.0)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "no_session"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", echo=True)
    assert client.models.list().data[0].id == "tiny"
    keys = Keys(ns)
    probe = redis.Redis.from_url(redis_server.url)
    assert probe.xlen(keys.prompts) == 0 and not list(probe.scan_iter(match=keys.inbox_prefix + "*"))
    probe.close()


def test_health_is_503_until_a_worker_serves_and_again_once_its_heartbeat_expired(
    redis_server: RedisServer, ns: str, workers: StartWorker, gateways: StartGateway
) -> None:
    """Issue 53: `/health` answered 200 with no worker, and a client that waited for it (as vLLM's clients wait for
    a server's `/health`) then got 503 `no_worker`. Now it is ready only while a worker serves, as vLLM's is only
    once its engine is up."""
    base = gateways("gw")

    def health() -> httpx.Response:
        return httpx.get(base.removesuffix("/v1") + "/health", timeout=10)

    unserved = {
        "error": {
            "message": f"no worker serves namespace {ns} (start `rollouts worker --ns {ns}`)",
            "type": "service_unavailable",
            "param": None,
            "code": "no_worker",
        }
    }
    before = health()
    assert (before.status_code, before.json()) == (503, unserved)
    worker = workers("w1", "--engine", "synthetic")  # returns once its heartbeat says `serving`
    ready = health()
    assert (ready.status_code, ready.json()) == (200, {"status": "ok", "workers": 1})
    reply = openai_client(base).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3)
    assert reply.choices[0].finish_reason == "length"  # ready means a call is served

    os.kill(worker.pid, signal.SIGKILL)  # no goodbye: only its heartbeat's expiry (5 s at the test's 0.3 s beat) tells
    worker.wait()
    wait_until(lambda: health().status_code == 503, 30, "/health to see the dead worker's heartbeat expire")
    assert health().json() == unserved
    assert not redis.Redis.from_url(redis_server.url).exists(Keys(ns).worker("w1"))


def test_the_model_names_a_lora_adapter_and_a_session_stays_on_it(
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    workers: StartWorker,
    gateways: StartGateway,
) -> None:
    """As on vLLM's server with LoRA modules: `model` is the base model's served name or an adapter's name; a
    session's turns and its finished trajectory are that adapter's (its tokens, its version)."""
    from consumers.engines.tiny_model import make_adapter

    favoured = range(100, 140)
    tensors, config = make_adapter(tiny_model_dir, list(favoured))
    trainer = RolloutClient(redis_server.url, ns)
    trainer.publish_weights(tensors, adapter="tenant-a", adapter_config=config)
    workers("w1")
    base = gateways("gw")
    client = openai_client(base)
    assert [m.id for m in client.models.list().data] == ["tiny", "tenant-a"]

    def ask(model: str, messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0.0,
            extra_headers={"X-Session-ID": "lora-1"},
            extra_body={"return_token_ids": True},
        )

    messages = [{"role": "user", "content": "Hello?"}]
    first = ask("tenant-a", messages)
    ids = first.choices[0].model_extra["token_ids"]
    assert np.mean([t in favoured for t in ids]) > 0.7, ids  # the adapter's tokens, not the base model's
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "?"}]
    with pytest.raises(openai.BadRequestError, match="every turn must name it"):
        ask("tiny", messages)
    second = ask("tenant-a", messages)
    assert all(s[0] == 1 for s in second.choices[0].model_extra["spans"])  # tenant-a's version 1
    with pytest.raises(openai.NotFoundError, match="`tenant-a`"):
        client.chat.completions.create(model="tenant-b", messages=messages, max_tokens=4)
    assert finish(base, "lora-1", reward=1.0).status_code == 200
    [group] = trainer.collect(1, timeout=30)
    assert group.adapter == "tenant-a" and group.rollouts[0].version == 1 and group.rollouts[0].reward == 1.0


def test_calls_without_a_session_spread_over_the_workers(
    redis_server: RedisServer, ns: str, workers: StartWorker, gateways: StartGateway
) -> None:
    """Sixteen concurrent completions without a session, four idle workers that could each take all of them: each
    worker serves some, and none more than its quarter and one."""
    names = [f"w{k}" for k in range(4)]
    workers.many(*[(name, *SLOW, "--max-inflight", "64") for name in names])
    client = openai_client(gateways("gw"))

    def call(k: int) -> None:
        client.completions.create(model="tiny", prompt=f"Count to {k}.", max_tokens=20, seed=k)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    registry = Streams(redis.Redis.from_url(redis_server.url), ns).registry

    def served() -> dict[str, int]:
        heartbeats = registry.live_workers()
        return {name: int(heartbeats[name]["published"]) for name in names}

    wait_until(lambda: sum(served().values()) == 16, 10, "the heartbeats to count the 16 published")
    assert max(served().values()) <= 5 and min(served().values()) >= 1, served()
