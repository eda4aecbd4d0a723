"""The `rollouts` command as a person runs it: real processes, real Redis, readable errors. A refusal, or a command
that only writes a file or a queue, runs in the test process through the typer app (`rollouts_here`); the pipeline,
the demo and `--help` run as processes of their own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread

from pipeline.codec import as_entries
from pipeline.local import RedisServer, free_port
from pipeline.processes import start_worker, stop_process, wait_for_worker
from pipeline.wire import Keys, Prompt
from producers.client import RolloutClient
from tests.cli.here import Ran, rollouts_here


def rollouts(*args: str, timeout: float = 120, python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`rollouts ARGS` in a process of its own (`python`: flags of the interpreter, e.g. `-X importtime`)."""
    return subprocess.run(
        [sys.executable, *python, "-m", "rollouts", *args], capture_output=True, text=True, timeout=timeout
    )


def imported(result: subprocess.CompletedProcess[str]) -> set[str]:
    """The modules a `rollouts(..., python=("-X", "importtime"))` run imported, as its stderr lists them."""
    return {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}


def assert_clean_error(result: Ran | subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 with a message that says what to fix, and no traceback (nor, run here, an uncaught error)."""
    result = result if isinstance(result, Ran) else Ran.of(result)
    output = result.stdout + result.stderr
    assert result.code == 2, output
    assert result.clean, result
    for needle in needles:
        assert needle in output, output


def test_submit_file_then_top_json_shows_the_pipeline(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "text-1", "prompt": "what is 2 + 2?", "n": 2, "max_tokens": 6, "meta": {"answer": 4}},
        {"id": "tok-1", "tokens": [5, 6, 7], "n": 3, "max_tokens": 4, "temperature": 0.7},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    url = redis_server.url
    submitted = rollouts("submit", "--redis", url, "--ns", ns, "--file", str(prompts), "--model", str(tiny_model_dir))
    assert submitted.returncode == 0, submitted.stderr
    assert "queued 2 prompts (5 samples)" in submitted.stderr
    assert "no worker is alive on namespace" in " ".join(submitted.stderr.split())
    # The same file again queues nothing (the ids are a repeat), and says so rather than claiming success.
    again = rollouts("submit", "--redis", url, "--ns", ns, "--file", str(prompts), "--model", str(tiny_model_dir))
    assert again.returncode == 0, again.stderr
    assert "queued 0 prompts: 2 of 2 were already submitted under the same ids" in " ".join(again.stderr.split())

    snap = json.loads(rollouts("top", "--redis", url, "--ns", ns, "--once", "--json").stdout)
    assert snap["streams"]["prompts"]["length"] == 2
    assert snap["streams"]["prompts"]["groups"]["generators"]["lag"] == 2
    assert snap["workers"] == {}

    worker = start_worker(url, ns, tiny_model_dir, "cli-w", log_file=tmp_path / "w.log")
    try:
        client = RolloutClient(url, ns, tokenizer=tiny_model_dir, trim_every_s=3600)  # keep acked rollouts to count
        wait_for_worker(client.streams.redis, ns, "cli-w", worker, timeout_s=120)
        groups = {g.prompt_id: g for g in client.collect(2, timeout=60)}
        assert set(groups) == {"text-1", "tok-1"}
        assert groups["text-1"].rollouts[0].meta == {"answer": 4}
        # The text prompt went through the tokenizer's chat template.
        text_prompt = groups["text-1"].rollouts[0].prompt_tokens.tolist()
        assert text_prompt == client.make_prompt("what is 2 + 2?").tokens.tolist() != []

        snap = json.loads(rollouts("top", "--redis", url, "--ns", ns, "--once", "--json").stdout)
        assert snap["streams"]["rollouts"]["length"] == 5
        assert snap["streams"]["prompts"]["groups"]["generators"] == {"lag": 0, "pending": 0, "consumers": 1}
        assert snap["streams"]["rollouts"]["groups"]["trainer"]["pending"] == 0
        assert snap["workers"]["cli-w"]["status"] == "serving"
        assert snap["workers"]["cli-w"]["version"] == "0"
        assert snap["workers"]["cli-w"]["engine"] == "torch"
        table = rollouts("top", "--redis", url, "--ns", ns, "--once")
        assert "cli-w" in table.stdout and "generators" in table.stdout
    finally:
        stop_process(worker)
    # Its log, written to a file, has one plain line a record: timestamped, the logger named, never wrapped.
    started = [line for line in (tmp_path / "w.log").read_text().splitlines() if "engine started" in line]
    line = r"\d{4}-\d\d-\d\d [\d:,]+ INFO consumers\.engine_keeper: cli-w: engine started .* at version 0$"
    assert started and re.match(line, started[0]), started


def test_submit_carries_a_prompts_files_sampling_knobs_to_the_workers(
    redis_server: RedisServer, ns: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`top_k`, `min_p`, `repetition_penalty`, `presence_penalty`, `frequency_penalty` and `min_tokens` on a line go
    on the wire as written and the worker honours them: top-k 1 at temperature 1 draws the greedy tokens, a huge
    repetition penalty repeats no token. A knob out of range names its line and field, and nothing is queued."""
    tokens = list(range(10, 20))  # greedy decoding repeats itself from here (seed-0 weights)
    spread = {"repetition_penalty": 10000.0, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.1,
              "min_tokens": 12}  # fmt: skip
    lines = [
        {"id": "greedy", "tokens": tokens, "max_tokens": 12, "temperature": 0},
        {"id": "top-1", "tokens": tokens, "n": 2, "max_tokens": 12, "top_k": 1, "seed": 3},
        {"id": "spread", "tokens": tokens, "max_tokens": 12, "temperature": 0.5, "seed": 4} | spread,
    ]
    prompts = tmp_path / "knobs.jsonl"
    prompts.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    url = redis_server.url
    bad = tmp_path / "bad-knobs.jsonl"
    bad.write_text('{"tokens": [1], "top_k": -3, "min_p": 2}\n{"tokens": [1], "max_tokens": 4, "min_tokens": 5}\n')
    assert_clean_error(
        rollouts_here("submit", "--redis", url, "--ns", ns, "--file", str(bad)),
        "2 bad lines, nothing was queued",
        "line 1: top_k must be -1 or 0 (off) or >= 1, got -3; min_p must be in [0, 1], got 2.0",
        "line 2: min_tokens must be in [0, max_tokens=4], got 5",
    )
    submitted = rollouts("submit", "--redis", url, "--ns", ns, "--file", str(prompts))
    assert submitted.returncode == 0 and "queued 3 prompts (4 samples)" in submitted.stderr, submitted.stderr
    client = RolloutClient(url, ns)
    entries = {Prompt.from_fields(f).id: json.loads(f[b"sampling"]) for _, f in as_entries(
        client.streams.redis.xrange(Keys(ns).prompts))}  # fmt: skip
    assert entries["top-1"] == {"max_tokens": 12, "top_k": 1, "seed": 3}
    assert entries["spread"] == {"max_tokens": 12, "temperature": 0.5, "seed": 4} | spread

    worker = start_worker(url, ns, tiny_model_dir, "knobs-w", log_file=tmp_path / "w.log")
    try:
        wait_for_worker(client.streams.redis, ns, "knobs-w", worker, timeout_s=120)
        groups = {g.prompt_id: [r.tokens.tolist() for r in g.rollouts] for g in client.collect(3, timeout=60)}
    finally:
        stop_process(worker)
    [greedy] = groups["greedy"]
    assert len(greedy) - len(set(greedy)) > 5
    assert groups["top-1"] == [greedy, greedy]
    [spread_tokens] = groups["spread"]
    assert len(spread_tokens) == 12 and len(set(spread_tokens)) == 12 and not set(spread_tokens) & set(tokens)


def test_a_bad_prompts_file_queues_nothing_and_names_every_bad_line(
    redis_server: RedisServer, ns: str, tmp_path: Path
) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(
        '{"tokens": [1, 2], "n": 2}\n'
        "not json\n"
        '{"tokens": [1], "n": 0}\n'
        '{"prompt": "hi", "tokens": [1]}\n'
        '{"tokens": [1], "temperature": -2}\n'
        '{"tokens": [1], "colour": "red"}\n'
    )
    result = rollouts_here("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(prompts))
    assert_clean_error(
        result,
        "5 bad lines, nothing was queued",
        "line 2: not JSON",
        "line 3: n:",
        "line 4: give exactly one of",
        "line 5: temperature must be >= 0",
        "line 6: colour",
    )
    text_only = tmp_path / "text.jsonl"
    text_only.write_text('{"prompt": "hello"}\n')
    result = rollouts_here("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(text_only))
    assert_clean_error(result, "text prompts need a tokenizer")
    client = RolloutClient(redis_server.url, ns)
    assert client.streams.redis.xlen(Keys(ns).prompts) == 0


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["top", "--once", "--redis", "redis://127.0.0.1:{port}/0"], ["cannot reach Redis", "--redis URL"]),
        (["submit", "--file", "/no/such/file.jsonl"], ["no prompts file at /no/such/file.jsonl"]),
        (["worker", "--model", "/no/such/model"], ["--model /no/such/model: no such directory", "--model smollm2"]),
        (["worker", "--model", "/tmp", "--engine", "tensorflow"], ["unknown engine 'tensorflow'"]),
        (["worker", "--model", "/tmp", "--engine-args", "[1, 2]"], ["--engine-args must be a JSON object"]),
        (["publish-weights", "--from", "/tmp", "--mode", "pause"], ["--mode must be one of abort, keep, inflight"]),
        (["top", "--once", "--ns", "a:b", "--redis", "{url}"], ["namespace 'a:b'"]),
        (["demo", "--plot", "/no/such/dir/curve.png"], ["--plot /no/such/dir/curve.png: there is no directory"]),
    ],
)
def test_argument_and_connection_errors_say_what_to_fix(
    redis_server: RedisServer, args: list[str], needles: list[str]
) -> None:
    args = [a.format(port=free_port(), url=redis_server.url) for a in args]
    assert_clean_error(rollouts_here(*args), *needles)


def test_publish_weights_of_an_adapter_needs_a_peft_directory(tiny_model_dir: Path) -> None:
    """A base checkpoint given as an adapter is refused in one line, before anything is published."""
    result = rollouts_here("publish-weights", "--from", str(tiny_model_dir), "--adapter", "a")
    assert_clean_error(result, f"--adapter a: {tiny_model_dir} has no adapter_config.json")


def test_tiny_model_seeds_give_the_same_tokenizer_and_other_weights(tmp_path: Path) -> None:
    for seed in ("0", "1"):
        result = rollouts_here("tiny-model", str(tmp_path / seed), "--seed", seed)
        assert result.code == 0 and result.clean, result
    assert (tmp_path / "0" / "tokenizer.json").read_bytes() == (tmp_path / "1" / "tokenizer.json").read_bytes()
    weights = [(tmp_path / seed / "model.safetensors").read_bytes() for seed in ("0", "1")]
    assert weights[0] != weights[1]


def test_demo_runs_end_to_end_and_its_reward_rises_as_the_weights_change(tmp_path: Path) -> None:
    """The CI's first command, as a user sees it: the round's summary, then the GRPO table and the curve."""
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(  # in tmp_path: a relative --plot is a file of the current directory
        [sys.executable, "-m", "rollouts", "demo", "--prompts", "4", "--n", "2", "--max-tokens", "8",
         "--plot", "c.png"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "demo summary" in output and "4 / 8" in output
    assert "demo summary" in result.stdout and "reward " in result.stdout, "the results go to stdout"
    assert "groups" in result.stderr and "demo summary" not in result.stderr, "progress goes to stderr"
    assert "redis-cli -p" not in output and "while its Redis runs: rollouts demo --keep" in output  # it is gone now

    assert "GRPO on the token-set task, fully async: step 100/100" in output, output
    rows = [tuple(map(float, m)) for m in re.findall(r"│\s+(\d+) │\s+(\d+) │\s+([\d.]+) │", output)]
    assert [int(step) for step, _, _ in rows] == [1, *range(11, 101, 10), 100], output
    assert all(version == step for step, version, _ in rows), "every step published a version to the worker"
    rewards = [reward for _, _, reward in rows]
    assert rewards[-1] > rewards[0] + 0.3 and max(rewards[:2]) < 0.1, f"the table shows no rise: {rewards}"
    means = re.search(r"reward ([\d.]+) → ([\d.]+) \(mean of the first and last 5", output)
    assert means is not None, output
    first, last = map(float, means.groups())
    assert first < 0.1 and last > 0.5, output

    curve = tmp_path / "c.png"
    assert f"learning curve: {curve.resolve()}" in output, output
    assert list(tmp_path.iterdir()) == [curve], "nothing else is left in the current directory"
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(curve).shape
    assert (width, height) == (1100, 396), "the figure as drawn: 10 x 3.6 inches at 110 dpi"


def test_prompt_ids_are_kept_from_the_file(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "mine", "tokens": [4, 5], "n": 2, "seed": 7}\n')
    submitted = rollouts_here("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(prompts))
    assert submitted.code == 0 and submitted.clean, submitted
    client = RolloutClient(redis_server.url, ns)
    ((_, fields),) = as_entries(client.streams.redis.xrange(Keys(ns).prompts))
    prompt = Prompt.from_fields(fields)
    assert (prompt.id, prompt.n, prompt.tokens.tolist(), prompt.sampling.seed) == ("mine", 2, [4, 5], 7)


def test_help_submit_and_top_never_import_torch(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    """The light commands start in a fraction of a second: none imports torch (1.5-2.5 s), as none needs it (a text
    prompt's tokenizer aside: transformers'). A synthetic worker's start: `test_synthetic_engine.py`."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "light", "tokens": [4, 5], "n": 1}\n')
    where = ("--redis", redis_server.url, "--ns", ns)
    runs = {
        "--help": rollouts("--help", python=("-X", "importtime")),
        "submit": rollouts("submit", *where, "--file", str(prompts), python=("-X", "importtime")),
        "top": rollouts("top", *where, "--once", "--json", python=("-X", "importtime")),
    }
    for command, result in runs.items():
        assert result.returncode == 0, (command, result.stderr[-2000:])
        modules = imported(result)
        assert "typer" in modules and "torch" not in modules, f"rollouts {command} imported torch"
    assert json.loads(runs["top"].stdout)["streams"]["prompts"]["length"] == 1


def test_a_workers_blocking_reads_wait_at_most_one_heartbeat_period() -> None:
    """A worker checks for a stop between reads: one that beats every 0.3 s stops within 0.3 s of SIGTERM, not the
    1 s a default read blocks for; a slow heartbeat does not make reads longer than that 1 s."""
    from consumers.settings import WorkerSettings

    assert [WorkerSettings.for_process(heartbeat_s=beat).block_ms for beat in (0.3, 1.0, 5.0)] == [300, 1000, 1000]


def test_a_worker_process_of_its_own_freezes_its_heap_and_one_inside_another_program_does_not() -> None:
    """`rollouts worker` and `rollouts launch`'s actors own their processes (`freeze_heap`, tested in test_lazy.py);
    a `Worker` built inside someone's program leaves that program's collector alone."""
    from consumers.settings import WorkerSettings

    assert WorkerSettings.for_process().freeze_heap is True and WorkerSettings().freeze_heap is False


def test_a_worker_flag_defaults_to_its_setting_and_a_beat_sets_its_heartbeat_life_and_deadline() -> None:
    """Each default once (`consumers.settings`): `rollouts worker`'s and `rollouts launch`'s options show the
    settings' own, and the bounds derived from the heartbeat are derived in one place."""
    import typer

    from consumers.settings import DEAD_AFTER_PERIODS, DEFAULTS, HEARTBEAT_TTL_PERIODS, WorkerSettings
    from rollouts import app
    from rollouts.worker_flags import WORKER_FLAGS

    commands: dict[str, Any] = getattr(typer.main.get_command(app), "commands")  # noqa: B009  # a click group's
    for command in ("worker", "launch"):
        options = {p.name: p.default for p in commands[command].params}
        assert {flag: options[flag] for flag in WORKER_FLAGS} == {f: getattr(DEFAULTS, f) for f in WORKER_FLAGS}
    slow = WorkerSettings.for_process(heartbeat_s=4.0)
    assert (slow.heartbeat_ttl_s, slow.dead_after_s) == (HEARTBEAT_TTL_PERIODS * 4.0, DEAD_AFTER_PERIODS * 4.0)
    assert WorkerSettings.for_process(heartbeat_s=0.1).dead_after_s == DEFAULTS.dead_after_s  # never under it


def test_a_remote_worker_needs_the_url_of_its_server(tiny_model_dir: Path) -> None:
    """`--engine remote` without `--url` is refused in one line, before anything connects."""
    result = rollouts_here("worker", "--engine", "remote", "--model", str(tiny_model_dir))
    assert_clean_error(result, "--engine remote needs --url")


def test_help_lists_the_user_commands_and_the_lab_runs_hidden_beside_them() -> None:
    """`rollouts --help` shows what a user runs and points to `rollouts-bench`; the lab's commands still run under
    `rollouts` (hidden), registered through the `rollouts.commands` entry point."""
    shown = rollouts("--help", timeout=60)
    assert shown.returncode == 0, shown.stderr
    commands = set(re.findall(r"^│ ([a-z][a-z-]+) ", shown.stdout, re.MULTILINE))
    assert {"worker", "manager", "submit", "top", "publish-weights", "demo", "gateway"} <= commands, commands
    assert not commands & {"bench", "bench-sync", "bench-broker", "soak", "scale", "chaos"}, commands
    assert "rollouts-bench --help" in " ".join(shown.stdout.split())
    bench = rollouts("bench", "--help", timeout=60)
    assert bench.returncode == 0 and "--paired" in bench.stdout, bench.stderr


def test_a_plugin_that_fails_to_load_is_skipped_and_named_under_debug_logging(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib
    from importlib.metadata import EntryPoint

    import typer

    shell = importlib.import_module("rollouts.app")  # the module: `rollouts`' attribute `app` is the app

    broken = EntryPoint(name="broken", value="no_such_plugin_module:register", group=shell.PLUGINS)
    monkeypatch.setattr(shell, "entry_points", lambda group: [broken])
    monkeypatch.setattr(shell, "skipped_plugins", [])
    target = typer.Typer()
    shell.load_plugins(target)  # no exception: `rollouts` runs without it
    assert shell.skipped_plugins == [
        ("no_such_plugin_module:register", "ModuleNotFoundError: No module named 'no_such_plugin_module'")
    ]
    caplog.set_level("DEBUG", logger=shell.log.name)
    shell.setup_logging("debug")
    assert "commands of no_such_plugin_module:register left out: ModuleNotFoundError" in caplog.text
