"""The `rollouts` command as a person runs it: real processes, real Redis, readable errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from matplotlib.image import imread

from consumers.engines.synthetic_engine import SyntheticEngine
from pipeline.cli.bench import SharedEngine, balanced_ratio, room_for_both
from pipeline.cli.engine_spec import EngineSpec
from pipeline.cli.processes import start_worker, stop_process, wait_for_worker
from pipeline.local import RedisServer, free_port
from pipeline.wire import Keys, Prompt
from producers.client import RolloutClient


def rollouts(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def assert_clean_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """A non-zero exit with a message that says what to fix, and no traceback."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
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
    result = rollouts("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(prompts))
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
    result = rollouts("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(text_only))
    assert_clean_error(result, "text prompts need a tokenizer")
    client = RolloutClient(redis_server.url, ns)
    assert client.streams.redis.xlen(Keys(ns).prompts) == 0


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["top", "--once", "--redis", "redis://127.0.0.1:{port}/0"], ["cannot reach Redis", "--redis URL"]),
        (["submit", "--file", "/no/such/file.jsonl"], ["no prompts file at /no/such/file.jsonl"]),
        (["worker", "--model", "/no/such/model"], ["no model at /no/such/model", "rollouts tiny-model"]),
        (["worker", "--model", "/tmp", "--engine", "tensorflow"], ["unknown engine 'tensorflow'"]),
        (["worker", "--model", "/tmp", "--engine-args", "[1, 2]"], ["--engine-args must be a JSON object"]),
        (["publish-weights", "--from", "/tmp", "--mode", "pause"], ["--mode must be abort or keep"]),
        (["top", "--once", "--ns", "a:b", "--redis", "{url}"], ["namespace 'a:b'"]),
        (["demo", "--plot", "/no/such/dir/curve.png"], ["--plot /no/such/dir/curve.png: there is no directory"]),
    ],
)
def test_argument_and_connection_errors_say_what_to_fix(
    redis_server: RedisServer, args: list[str], needles: list[str]
) -> None:
    args = [a.format(port=free_port(), url=redis_server.url) for a in args]
    assert_clean_error(rollouts(*args, timeout=60), *needles)


def test_publish_weights_of_an_adapter_needs_a_peft_directory(tiny_model_dir: Path) -> None:
    """A base checkpoint given as an adapter is refused in one line, before anything is published."""
    result = rollouts("publish-weights", "--from", str(tiny_model_dir), "--adapter", "a", timeout=60)
    assert_clean_error(result, f"--adapter a: {tiny_model_dir} has no adapter_config.json")


def test_tiny_model_seeds_give_the_same_tokenizer_and_other_weights(tmp_path: Path) -> None:
    for seed in ("0", "1"):
        result = rollouts("tiny-model", str(tmp_path / seed), "--seed", seed)
        assert result.returncode == 0, result.stderr
    assert (tmp_path / "0" / "tokenizer.json").read_bytes() == (tmp_path / "1" / "tokenizer.json").read_bytes()
    weights = [(tmp_path / seed / "model.safetensors").read_bytes() for seed in ("0", "1")]
    assert weights[0] != weights[1]


def test_demo_runs_end_to_end_and_its_reward_rises_as_the_weights_change(tmp_path: Path) -> None:
    """The CI's first command, as a user sees it: the round's summary, then the GRPO table and the curve."""
    root = Path(__file__).resolve().parent.parent
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(  # in tmp_path: the default --plot is a file of the current directory
        [sys.executable, "-m", "pipeline.cli", "demo", "--prompts", "4", "--n", "2", "--max-tokens", "8"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "demo summary" in output and "4 / 8" in output
    assert "redis-cli -p" in output and "XRANGE '{demo}:rollouts'" in output

    assert "GRPO on the token-set task, fully async: step 100/100" in output, output
    rows = [tuple(map(float, m)) for m in re.findall(r"│\s+(\d+) │\s+(\d+) │\s+([\d.]+) │", output)]
    assert [int(step) for step, _, _ in rows] == [1, *range(11, 101, 10), 100], output
    assert all(version == step for step, version, _ in rows), "every step published a version to the worker"
    rewards = [reward for _, _, reward in rows]
    assert rewards[-1] > rewards[0] + 0.3 and max(rewards[:2]) < 0.1, f"the table shows no rise: {rewards}"
    first, last = map(float, re.search(r"reward ([\d.]+) → ([\d.]+) \(mean of the first and last 5", output).groups())
    assert first < 0.1 and last > 0.5, output

    curve = tmp_path / "rollouts-demo-curve.png"
    assert f"learning curve: {curve.resolve()}" in output, output
    assert curve.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(curve).shape
    assert (width, height) == (1100, 396), "the figure as drawn: 10 x 3.6 inches at 110 dpi"


def test_prompt_ids_are_kept_from_the_file(redis_server: RedisServer, ns: str, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "mine", "tokens": [4, 5], "n": 2, "seed": 7}\n')
    assert rollouts("submit", "--redis", redis_server.url, "--ns", ns, "--file", str(prompts)).returncode == 0
    client = RolloutClient(redis_server.url, ns)
    ((_, fields),) = client.streams.redis.xrange(Keys(ns).prompts)
    prompt = Prompt.from_fields(fields)
    assert (prompt.id, prompt.n, prompt.tokens.tolist(), prompt.sampling.seed) == ("mine", 2, [4, 5], 7)


def small_bench(model: Path, *flags: str) -> dict[str, Any]:
    """`rollouts bench` on the tiny model, 8 prompts of 2 samples of 32 tokens a round: its JSON report."""
    result = rollouts(
        "bench", "--model", str(model), "--prompts", "8", "--n", "2", "--max-tokens", "32", *flags, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_bench_compares_both_sides_on_the_same_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    report = small_bench(tiny_model_dir, "--rounds", "1", "--plot", str(plot))
    assert report["same_tokens"] is True
    assert report["direct"]["rollouts_per_s"] > 0 and report["pipeline"]["rollouts_per_s"] > 0
    assert report["ratio"] == pytest.approx(report["direct"]["seconds"][0] / report["pipeline"]["seconds"][0], rel=0.05)
    # The CPU goes to the process that ran the engine: this one on the direct side, the worker on the pipeline side.
    direct, pipeline = report["direct"]["cpu_s"], report["pipeline"]["cpu_s"]
    assert pipeline["worker"] > direct["worker"] and direct["bench"] > pipeline["bench"], (direct, pipeline)
    own = [cpu["bench"] + cpu["worker"] + cpu["redis"] for cpu in (direct, pipeline)]  # the engine's processes left out
    assert report["pipeline_extra_cpu_s"] == pytest.approx(own[1] - own[0], abs=0.005)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_with_one_engine_serves_both_sides_from_it_and_the_trainer_from_a_process_of_its_own(
    tiny_model_dir: Path,
) -> None:
    report = small_bench(tiny_model_dir, "--rounds", "2", "--one-engine")
    assert report["one_engine"] is True and report["same_tokens"] is True
    assert len(report["pipeline"]["seconds"]) == 2 and report["pipeline"]["rollouts_per_s"] > 0
    # One engine (torch: in this process), run by this process on both sides; the trainer works on the pipeline side.
    direct, pipeline = report["direct"]["cpu_s"], report["pipeline"]["cpu_s"]
    assert set(direct) == {"bench", "engine", "trainer", "redis", "total"}
    assert direct["trainer"] <= pipeline["trainer"] and min(direct["bench"], pipeline["bench"]) > 0, (direct, pipeline)
    own = [cpu["bench"] + cpu["trainer"] + cpu["redis"] for cpu in (direct, pipeline)]
    assert report["pipeline_extra_cpu_s"] == pytest.approx(own[1] - own[0], abs=0.01)


def test_bench_paired_runs_both_sides_in_the_same_engine_steps_and_balances_which_goes_first(
    tiny_model_dir: Path,
) -> None:
    report = small_bench(tiny_model_dir, "--rounds", "2", "--paired")
    assert report["paired"] is True and report["one_engine"] is True and report["same_tokens"] is True
    assert report["prompts_per_side"] == 4 and report["options"]["max_batch"] >= 16  # room for both sides' samples
    assert len(report["direct"]["seconds"]) == len(report["pipeline"]["seconds"]) == 2
    # Round 1 the pipeline went first, round 2 the direct side; the ratio is the two kinds' geometric mean.
    by_first = report["ratio_by_first"]
    assert by_first == {"pipeline": report["ratios"][0], "direct": report["ratios"][1]}
    assert report["ratio"] == pytest.approx((by_first["pipeline"] * by_first["direct"]) ** 0.5, abs=1e-4)
    # Both sides ran in the same seconds: the CPU is the round's, by role, not a side's.
    assert set(report["cpu_s"]) == {"bench", "engine", "trainer", "redis", "total"} and report["cpu_s"]["total"] > 0
    assert "cpu_s" not in report["direct"] and report["pipeline_extra_cpu_s"] is None
    too_few = rollouts("bench", "--paired", "--prompts", "1", timeout=60)
    assert too_few.returncode != 0 and "--paired splits a round's prompts" in too_few.stderr
    assert "Traceback" not in too_few.stderr


def test_the_paired_ratio_cancels_the_advantage_of_going_second() -> None:
    """The side that goes second finishes ~1 % sooner than it would have first (measured on vLLM): with an order
    effect `o` and a pipeline cost `p`, the rounds alternate between two ratios around `1 / (1 + p)`."""
    o, p = 0.012, 0.008
    pipeline_first, direct_first = (1 - o) / (1 + p), 1 / ((1 - o) * (1 + p))
    noise = [0.998, 1.003, 1.0, 0.997, 1.002, 1.001]
    ratios = [(pipeline_first if i % 2 == 0 else direct_first) * e for i, e in enumerate(noise * 5)]
    by_first, ratio = balanced_ratio(ratios)
    assert by_first["pipeline"] < 1 / (1 + p) < by_first["direct"]
    assert ratio == pytest.approx(1 / (1 + p), abs=0.002)


def test_paired_gives_the_engine_room_for_both_sides_or_says_why_it_cannot() -> None:
    vllm = EngineSpec(kind="vllm", model=Path("m"))
    assert room_for_both(vllm, 256).engine_args == {"max_num_seqs": 256}
    assert room_for_both(replace(vllm, engine_args={"max_num_seqs": 512}), 256).engine_args == {"max_num_seqs": 512}
    with pytest.raises(ValueError, match="max_num_seqs 64 is too small"):
        room_for_both(replace(vllm, engine_args={"max_num_seqs": 64}), 256)
    assert room_for_both(EngineSpec(kind="torch", model=Path("m")), 256).max_batch == 256


def test_a_bench_trainer_that_dies_is_reported_with_the_end_of_its_log(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """`--one-engine`'s trainer process fails (here: asked for prompts from a vocabulary of no tokens) and exits: the
    bench says so with the end of its log, since the log itself goes with the bench's temporary directory."""
    shape = {"prompts": 1, "n": 1, "max_tokens": 4, "vocab": 0}
    side = SharedEngine(redis_server.url, SyntheticEngine(), shape, tmp_path / "trainer.log")
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match=r"the bench's trainer exited with code 1: .*ValueError"):
            side.round(loop, [], "r0")
    finally:
        side.close(loop)
        loop.close()


def test_bench_sync_reports_the_stall_per_transport(tmp_path: Path) -> None:
    plot = tmp_path / "sync.png"
    logs = tmp_path / "logs"
    result = rollouts(
        "bench-sync", "--sizes", "tiny", "--rounds", "2", "--plot", str(plot), "--logs", str(logs), timeout=300
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [(r["size"], r["transport"]) for r in report["results"]] == [
        ("tiny", "redis"),
        ("tiny", "fs"),
        ("tiny", "nccl"),
    ]
    for row in report["results"]:
        assert row["parameters"] == 148_160 and row["bytes"] == 4 * 148_160
        assert 0 < row["sync_s"] <= row["publish_to_serving_s"] and 0 < row["stall_s"] <= row["publish_to_serving_s"]
    nccl = report["results"][2]
    # The worker joins and builds its group before it pauses: the first sync's setup is not time it stood still.
    assert nccl["first_stall_s"] < nccl["first_sync_s"] - nccl["first_setup_s"], nccl
    assert nccl["gb_per_s"] > 0 and 0 < nccl["broadcast_s"] < nccl["sync_s"] and 0 <= nccl["ready_s"] < nccl["sync_s"]
    assert nccl["first_setup_s"] > 0 and nccl["setup_s_rounds"][1:] == [0.0], "the second sync built a new group"
    assert sorted(p.name for p in logs.iterdir()) == ["tiny-fs.log", "tiny-nccl.log", "tiny-redis.log"]
    assert "broadcast" in (logs / "tiny-nccl.log").read_text()  # the worker's own log, kept
    assert plot.read_bytes()[:4] == b"\x89PNG"
    idle = rollouts("bench-sync", "--sizes", "tiny", "--transports", "nccl", "--rounds", "2", "--idle", timeout=300)
    assert idle.returncode == 0, idle.stderr
    assert json.loads(idle.stdout)["results"][0]["broadcast_s"] > 0
    assert_clean_error(rollouts("bench-sync", "--sizes", "huge"), "unknown sizes ['huge']")


def test_a_workers_blocking_reads_wait_at_most_one_heartbeat_period() -> None:
    """A worker checks for a stop between reads: one that beats every 0.3 s stops within 0.3 s of SIGTERM, not the
    1 s a default read blocks for; a slow heartbeat does not make reads longer than that 1 s."""
    from pipeline.cli import worker_settings

    assert [worker_settings(256, 10_000, beat).block_ms for beat in (0.3, 1.0, 5.0)] == [300, 1000, 1000]


def test_a_worker_process_of_its_own_freezes_its_heap_and_one_inside_another_program_does_not() -> None:
    """`rollouts worker` and `rollouts launch`'s actors own their processes (`freeze_heap`, tested in test_lazy.py);
    a `Worker` built inside someone's program leaves that program's collector alone."""
    from consumers.worker import WorkerSettings
    from pipeline.cli import worker_settings

    assert worker_settings(256, 10_000, 1.0).freeze_heap is True and WorkerSettings().freeze_heap is False


def test_a_remote_worker_needs_the_url_of_its_server(tiny_model_dir: Path) -> None:
    """`--engine remote` without `--url` is refused in one line, before anything connects."""
    result = rollouts("worker", "--engine", "remote", "--model", str(tiny_model_dir), timeout=60)
    assert_clean_error(result, "--engine remote needs --url")
