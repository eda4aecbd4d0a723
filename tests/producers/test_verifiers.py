"""verifiers 0.4.0's own train client (renderers' client, `client.type train` in `vf-eval` terms: what prime-rl runs)
drives real workers through `rollouts gateway`, and `producers.integrations.verifiers` hands its traces to
`RolloutClient` as whole groups: a single-turn `SingleAgentEnv` and the built-in multi-turn `user-sim` environment
(tests/verifiers_driver.py, in a venv of its own), with new weights published while the `user-sim` group runs.

verifiers pins `openai<3` (the gateway's tests speak openai 3), so it is installed in a venv of its own, built once
and cached under `~/.cache/rollout-streams/`: `verifiers` and `renderers` without their dependencies, plus what the
paths driven here import (`VERIFIERS_DEPS`), and the product's `redis` client for `VerifiersRollouts`; the product
itself comes from this checkout (the driver puts it on `sys.path`). Nothing is fetched at run time (no Prime sandbox,
no `uv`: tests/verifiers_driver.py says how)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import redis
from transformers import AutoTokenizer

from pipeline.install import pip_install
from pipeline.local import RedisServer
from pipeline.wire import Keys, Rollout
from producers.client import RolloutClient
from tests.fixtures import StartGateway, StartWorker, cached_venv
from tests.reference import forward_logprobs

VERIFIERS = ["verifiers==0.4.0", "renderers==0.1.12"]
VERIFIERS_DEPS = [
    # what `import verifiers.v1` imports (its runtimes, clients, tasksets and scoring modules load at import)
    "prime-pydantic-config==0.4.3", "pydantic==2.14.4", "pydantic_core==2.50.5", "typing_extensions==4.16.0",
    "typing-inspection==0.4.5", "annotated-types==0.8.0", "openai==2.54.0", "anthropic==2.17.0", "httpx==0.29.0",
    "httpcore==1.0.9", "httpx2==2.17.0", "httpcore2==2.17.0", "h11==0.16.0", "anyio==4.16.0", "sniffio==1.3.1",
    "idna==3.21", "certifi==2026.10.19.post1", "truststore==0.10.5", "distro==1.9.0", "jiter==0.19.0",
    "docstring_parser==0.18.0", "numpy==2.4.6", "tenacity==9.2.1", "tomli_w==1.2.0", "aiofiles==25.1.0",
    "aiohttp==3.14.5", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "attrs==26.1.0", "frozenlist==1.8.0",
    "multidict==7.2.1", "propcache==0.5.4", "yarl==1.25.1", "prime-sandboxes==0.5.1", "connectrpc==0.11.1",
    "pyqwest==0.12.0", "protobuf==7.36.2", "protobuf-py==0.1.1", "opentelemetry-api==1.45.3", "math-verify==0.9.0",
    "latex2sympy2_extended==1.11.0", "sympy==1.14.0", "mpmath==1.3.0", "antlr4-python3-runtime==4.13.2",
    # verifiers' chat program (the `null` harness's agent), run with the venv's Python
    "mcp==2.0.0", "mcp-types==2.0.0", "starlette==1.10.0", "sse-starlette==3.7.1", "cryptography==51.0.1",
    "cffi==2.1.1",
    # renderers' tokenizer and chat template (transformers without torch)
    "transformers==5.19.0", "tokenizers==0.23.3", "huggingface_hub==2.4.0", "safetensors==0.8.0", "packaging==26.4",
    "regex==2026.11.19", "tqdm==4.70.1", "PyYAML==6.0.4", "filelock==4.3.1", "Jinja2==3.1.6", "MarkupSafe==3.0.4",
    "openai-harmony==0.0.8",
    # the product's `VerifiersRollouts` (numpy, pydantic and httpx are above)
    "redis==8.1.0", "hiredis==3.5.0",
]  # fmt: skip
"""Found by running the driver in a venv of `VERIFIERS` alone and adding what it missed, one module at a time, at the
versions a full `pip install verifiers==0.4.0` resolved (or `constraints.txt`'s, where it pins the package)."""
DRIVER = Path(__file__).resolve().parents[1] / "verifiers_driver.py"
GROUP_SIZE = 2
USER_TURNS = 3
MAX_TOKENS = 16


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    """The Python of a venv with verifiers, renderers and what the driver needs (`--no-compile`: a first import
    compiles what it reads, so nothing else is compiled: ~20 s of the build saved on 2 cores)."""
    return cached_venv("verifiers-0.4.0", sys.executable, [["--no-deps", "--no-compile", *VERIFIERS, *VERIFIERS_DEPS]])


def sampled_runs(mask: list[bool]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, sampled in enumerate(mask):
        if sampled and (not runs or runs[-1][1] != i):
            runs.append((i, i + 1))
        elif sampled:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


def template(tokenizer: Any, messages: list[dict[str, Any]], text: bool = False) -> Any:
    """The chat template's rendering of `messages` with the generation prompt: token ids (or its text)."""
    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
    out = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=not text, return_dict=False)
    return out if text else list(out)


def span_logprobs(models: dict[int, Path], prompt: list[int], tokens: list[int], spans: list[Any]) -> np.ndarray:
    """Each token's logprob under its span's version, over the whole prefix (`abort`: a sample interrupted by the sync
    continues under the new weights, which read its prefix again)."""
    out = np.zeros(len(tokens), np.float32)
    for version, start, end in spans:
        out[start:end] = forward_logprobs(models[int(version)], prompt, tokens)[start:end]
    return out


def check_group(
    report: dict[str, Any], rollouts: list[Rollout], tokenizer: Any, models: dict[int, Path]
) -> list[dict[str, Any]]:
    """What a user of verifiers and a trainer would both check, for one group; returns its trainable traces."""
    # Every episode and trace of the group ran to its end: no HarnessError, no provider error, nothing left out.
    assert report["failed"] == [], report["failed"]
    traces = [t for e in report["episodes"] for t in e["traces"]]
    assert all(e["ok"] and not e["errors"] for e in report["episodes"]), report["episodes"]
    assert all(t["ok"] and not t["errors"] for t in traces), [t["errors"] for t in traces]
    assert "HarnessError" not in json.dumps(report)
    trainable = [t for t in traces if t["trainable"]]
    assert len(trainable) == GROUP_SIZE

    # One rollout per branch of each trainable trace, as one whole group; each is verifiers' branch, unchanged.
    branches = [(t, k, b) for t in trainable for k, b in enumerate(b for b in t["branches"] if any(b["sampled_mask"]))]
    assert [r.id for r in rollouts] == report["rollout_ids"] and report["published"] == len(rollouts)
    assert len(rollouts) == len(branches) and all(r.n == len(branches) for r in rollouts)
    assert [r.sample for r in rollouts] == list(range(len(rollouts)))
    for rollout, (trace, k, branch) in zip(rollouts, branches, strict=True):
        meta = rollout.meta
        assert (meta["trace"], meta["branch"], meta["agent"]) == (trace["id"], k, trace["agent"])
        ids, mask = branch["token_ids"], branch["sampled_mask"]
        runs = sampled_runs(mask)
        first = runs[0][0]
        assert rollout.prompt_tokens.tolist() == ids[:first] and rollout.tokens.tolist() == ids[first:]
        assert rollout.mask == [(s - first, e - first) for s, e in runs]
        np.testing.assert_allclose(rollout.logprobs, branch["logprobs"][first:], atol=1e-6)
        assert rollout.reward == trace["reward"] and rollout.meta["rewards"] == {"replied": trace["reward"]}
        assert "reply_chars" in rollout.meta["metrics"]

        # The prompt is the chat template's, token for token: the messages before the first reply the model wrote.
        sizes = [node["tokens"] for node in branch["nodes"]]
        sampled_nodes = [i for i, node in enumerate(branch["nodes"]) if node["sampled"]]
        assert len(sampled_nodes) == len(runs)
        assert rollout.prompt_tokens.tolist() == template(tokenizer, branch["messages"][: sampled_nodes[0]])
        # Between two replies carried in one branch: the template's tokens of the messages between them (the user's).
        for (_, end), (start, _), node in zip(runs[:-1], runs[1:], sampled_nodes[1:], strict=True):
            assert start == sum(sizes[:node]) + sizes[node] - branch["nodes"][node]["sampled"]
            between = tokenizer.decode(ids[end:start])
            assert template(tokenizer, branch["messages"][:node], text=True).endswith(between)
            assert (branch["messages"][node - 1].get("content") or "") in between

        # The logprobs are the model's: a plain forward pass of the version that wrote each token, where the model
        # wrote (0 elsewhere); the spans cover every token, in order.
        spans = rollout.spans
        assert spans[0][1] == 0 and spans[-1][2] == rollout.n_tokens
        assert all(a[2] == b[1] for a, b in itertools.pairwise(spans))
        assert (rollout.version, rollout.version_end) == (spans[0][0], spans[-1][0])
        written = np.zeros(rollout.n_tokens, bool)
        for s, e in rollout.mask or []:
            written[s:e] = True
        reference = span_logprobs(models, rollout.prompt_tokens.tolist(), rollout.tokens.tolist(), spans)
        np.testing.assert_allclose(rollout.logprobs[written], reference[written], atol=2e-4)
        assert not rollout.logprobs[~written].any()
    return trainable


@pytest.mark.timeout(480)  # ~60 s, ~120 s on a loaded 2-core machine, and its venv's ~30-60 s the first time
def test_verifiers_train_client_runs_single_and_multi_turn_environments_through_the_gateway_into_whole_groups(
    verifiers_python: str,
    redis_server: RedisServer,
    ns: str,
    tiny_model_dir: Path,
    tiny_model_dir_v1: Path,
    workers: StartWorker,
    gateways: StartGateway,
    one_thread: None,
    tmp_path: Path,
) -> None:
    workers.many(("w1",), ("w2",))
    gateway = gateways("gw").removesuffix("/v1")
    config: dict[str, Any] = {"gateway": gateway, "redis": redis_server.url, "ns": ns, "model_dir": str(tiny_model_dir)}
    config |= {"max_tokens": MAX_TOKENS, "group_size": GROUP_SIZE, "user_turns": USER_TURNS}
    trainer = RolloutClient(redis_server.url, ns)
    log = tmp_path / "verifiers_driver.log"
    lines: list[dict[str, Any]] = []
    with open(log, "w") as err:
        driver = subprocess.Popen([verifiers_python, str(DRIVER), json.dumps(config)], stdout=subprocess.PIPE,
                                  stderr=err, text=True)  # fmt: skip
        try:
            assert driver.stdout is not None
            for line in driver.stdout:
                lines.append(json.loads(line))
                if lines[-1]["event"] == "started":  # the user-sim group is under way: the next version lands in it
                    assert trainer.publish_weights(tiny_model_dir_v1, transport="redis://") == 1
            driver.wait(timeout=30)
        finally:
            if driver.poll() is None:
                driver.kill()
    assert driver.returncode == 0, log.read_text()[-6000:]
    assert [line["event"] for line in lines] == ["single", "started", "user_sim"], log.read_text()[-6000:]
    single, user_sim = lines[0], lines[2]

    # Both groups reach the trainer whole, through RolloutClient, as any prompt's group does.
    groups = {g.prompt_id: g for g in trainer.collect(2, timeout=30)}
    assert set(groups) == {single["prompt_id"], user_sim["prompt_id"]}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    models = {0: tiny_model_dir, 1: tiny_model_dir_v1}

    # Single turn: one branch a trace, all of version 0.
    traces = check_group(single, groups[single["prompt_id"]].rollouts, tokenizer, models)
    assert all(t["turns"] == 1 and len(t["branches"]) == 1 for t in traces)
    assert all(r.spans == [(0, 0, r.n_tokens)] for r in groups[single["prompt_id"]].rollouts)

    # Multi-turn: the assistant's traces, each of USER_TURNS replies to the simulated user; the user's traces (its
    # calls ran on the fleet too) are left out of the group. The weights changed after an assistant's first reply:
    # its later turns are version 1's, in the same trace.
    traces = check_group(user_sim, groups[user_sim["prompt_id"]].rollouts, tokenizer, models)
    assert all(t["agent"] == "assistant" and t["turns"] == USER_TURNS for t in traces)
    users = [t for e in user_sim["episodes"] for t in e["traces"] if t["agent"] == "user"]
    assert len(users) == GROUP_SIZE == user_sim["untrainable"] and not any(t["trainable"] for t in users)
    rollouts = groups[user_sim["prompt_id"]].rollouts
    assert {r.meta["trace"] for r in rollouts} == {t["id"] for t in traces}
    for trace in traces:  # the conversation: the simulated user's replies are the assistant's prompts, in order
        (user,) = (u for e in user_sim["episodes"] if trace in e["traces"] for u in e["traces"] if u is not trace)
        conversation = max(trace["branches"], key=lambda b: len(b["messages"]))["messages"]
        assert [m["role"] for m in conversation] == ["user", "assistant"] * USER_TURNS
        said = max(user["branches"], key=lambda b: len(b["messages"]))["messages"]
        replies = [(m.get("content") or "").strip() for m in said if m["role"] == "assistant"]
        assert [(m.get("content") or "").strip() for m in conversation if m["role"] == "user"] == replies[:USER_TURNS]
    assert all(r.meta["metrics"]["user_turns"] == USER_TURNS for r in rollouts)
    written_by: dict[str, set[int]] = {}  # each trace's versions that wrote tokens of its replies
    for r in rollouts:
        ranges = r.mask or []
        written = {v for v, s, e in r.spans if any(s < end and start < e for start, end in ranges)}
        written_by.setdefault(r.meta["trace"], set()).update(written)
    assert {0, 1} in written_by.values(), written_by

    # Every session the gateway pinned (each trace's, the simulated user's too) was released: no pin, no session.
    assert single["released"] == GROUP_SIZE and user_sim["released"] == 2 * GROUP_SIZE
    check = redis.Redis.from_url(redis_server.url)
    keys = Keys(ns)
    assert not list(check.scan_iter(match=keys.session("*")))
    assert all(check.zcard(keys.pins(w)) == 0 for w in ("w1", "w2"))
    check.close()


def test_a_branch_takes_each_replys_versions_and_the_tokens_between_replies_the_version_before_them() -> None:
    """`branch_fields` on a branch as verifiers builds it (duck-typed: no verifiers here), two replies carried in one
    branch, the second interrupted by a sync."""
    from producers.integrations.verifiers import Reply, VersionsUnknown, branch_fields

    def node(tokens: list[int], sampled: int) -> SimpleNamespace:  # scaffold first, then what the model wrote
        return SimpleNamespace(token_ids=tokens, mask=[False] * (len(tokens) - sampled) + [True] * sampled)

    nodes = [node([1, 4, 50, 2], 0), node([5, 60, 61, 62], 3), node([2, 4, 70, 2, 5], 0), node([80, 81, 82, 83], 4)]
    branch = SimpleNamespace(
        nodes=nodes,
        token_ids=[t for n in nodes for t in n.token_ids],
        sampled_mask=[m for n in nodes for m in n.mask],
        logprobs=[0.0] * 5 + [-1.0, -2.0, -3.0] + [0.0] * 5 + [-4.0, -5.0, -6.0, -7.0],
        calls=[SimpleNamespace(error=None, finish_reason="stop"), SimpleNamespace(error=None, finish_reason="length")],
    )
    replies = [Reply((60, 61, 62), [(3, 0, 3)]), Reply((80, 81, 82, 83), [(3, 0, 1), (4, 1, 4)])]
    fields = branch_fields(branch, replies, "s")
    assert fields["prompt_tokens"].tolist() == [1, 4, 50, 2, 5]
    assert fields["tokens"].tolist() == [60, 61, 62, 2, 4, 70, 2, 5, 80, 81, 82, 83]
    assert fields["mask"] == [(0, 3), (8, 12)]
    assert fields["spans"] == [(3, 0, 9), (4, 9, 12)]
    assert (fields["version"], fields["version_end"], fields["finish_reason"]) == (3, 4, "length")
    assert fields["logprobs"].tolist() == [-1, -2, -3, 0, 0, 0, 0, 0, -4, -5, -6, -7]
    with pytest.raises(VersionsUnknown, match="match no answer"):
        branch_fields(branch, replies[:1], "s")


def test_without_verifiers_the_integration_imports_and_says_in_one_line_how_to_install_it() -> None:
    """`import producers.integrations.verifiers` needs no verifiers (it is an optional extra); using it does."""
    import importlib.util

    if importlib.util.find_spec("verifiers") is not None:
        pytest.skip("verifiers is installed here: the message is for an environment without it")
    from producers.integrations.verifiers import VerifiersRollouts

    with pytest.raises(ImportError) as raised:
        VerifiersRollouts(RolloutClient.__new__(RolloutClient), None, gateway="http://127.0.0.1:8000", model="m")
    message = str(raised.value)
    assert "\n" not in message and pip_install("verifiers") in message, message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
