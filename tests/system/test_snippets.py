"""Every fenced ```python and ```bash block of README.md, docs/wire-contract.md and docs/guide/*.md runs as written.

A small markdown parser takes each block out (test ids `FILE:LINE`, the line of the opening fence) and runs it:

- python: in a process of its own (`python RUNNER`), in a fresh temp dir, against a real redis-server with a tiny
  local model and (when the snippet makes a `RolloutClient`) a torch worker on the namespace its client names (`exp1`,
  the docs' namespace, where it names none: the README's trainer has one of its own).
  What a user brings is put in the namespace the snippet runs in, and nothing else: `model` (the tiny model of
  `./tiny`, a transformers `AutoModelForCausalLM`) and `train_step(...)` (a real SGD step: the completion tokens'
  cross-entropy on a batch's `to_arrays()` when one is passed, else on a short sequence; it returns the loss).
- bash: `bash -e -c BLOCK` in a fresh temp dir, in a process group of its own; when the block's foreground commands
  are done, the group (its `&` background jobs) is sent SIGTERM, then SIGKILL after a deadline.

Each block has a deadline (`TIMEOUT_S`, or `<!-- snippet: timeout S -->`): one that runs past it fails as a hang
(a trainer loop that submits past its admission capacity before reading, say).

The rewriting, all of it: `127.0.0.1:6380`, `--port 6380` and `redis-cli -p 6380` become the test's port (a bash block
that starts its own `redis-server --port 6380` gets a free port of its own; every other block the module's server,
flushed before each block that gets a fresh torch worker on `exp1`); `127.0.0.1:8000` (the gateway guide's) becomes the
port of a `rollouts gateway` that the test starts for the python block that names it (on `exp1`, the model served as
`policy`). The temp dir holds `./tiny` (python blocks: a link to the module's tiny model; bash blocks build it, as
written) and `examples` (a link to the repository's `examples/`), as a checkout's root does, and, for a python block
that reads `runs/exp1`, `runs/exp1`: a run of 16 prompts of 4 samples on `exp1` that `rollouts record` recorded, as the
recording guide's first block does. Nothing else is changed: a block that needs more says so in the markdown.

A comment on the line right before a fence says how to treat a block that cannot run here, and is counted:
`<!-- snippet: not run: WHY -->` (GPUs, docker compose, a Ray cluster, a network install, a fragment of a longer
program; name the test that covers it), `<!-- snippet: covered by FILE ... -->` (each of its lines is a line of a
block of FILE that runs; checked), `<!-- snippet: output -->` (an excerpt of what a command printed), and
`<!-- snippet: env NAME=VALUE ... -->` (runs, with those variables set: to shorten a long run; keep them rare).
A python or bash block with neither a run nor a marker fails. Blocks in other languages (```text, plain ```) are
output or diagrams, and are not run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from pipeline.local import RedisServer, find_redis_server, free_port
from pipeline.processes import start_command, start_worker, stop_processes, wait_for_worker
from tests.fixtures import wait_until

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "wire-contract.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~)\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*snippet:\s*(.*?)\s*-->\s*$")
RUN_LANGS = ("python", "bash")
TIMEOUT_S = 150.0
DOCS_PORT = "6380"
DOCS_NS = "exp1"
CLIENT_NS = re.compile(r'RolloutClient\(\s*"[^"]*",\s*"([^"]+)"')
GATEWAY_PORT = "8000"


@dataclass
class Snippet:
    path: Path
    line: int  # the opening fence's, 1-based
    lang: str
    code: str
    marker: str | None  # the `<!-- snippet: ... -->` right before the fence, if any
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = TIMEOUT_S

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:L{self.line}"

    @property
    def skip_reason(self) -> str | None:
        """Why the block is not run (its marker), or None."""
        if self.marker is None:
            return None
        if self.marker == "output":
            return "output: an excerpt of what a command printed"
        if self.marker.startswith(("not run:", "covered by ")):
            return self.marker
        return None


def parse_marker(snippet: Snippet) -> None:
    """Apply a run marker (`env NAME=VALUE ...`, `timeout S`); fail on one this test does not know."""
    marker = snippet.marker
    if marker is None or snippet.skip_reason is not None:
        return
    kind, _, rest = marker.partition(" ")
    if kind == "env":
        for word in shlex.split(rest):
            name, sep, value = word.partition("=")
            assert sep, f"{snippet.id}: `<!-- snippet: env {rest} -->` wants NAME=VALUE words"
            snippet.env[name] = value
    elif kind == "timeout":
        snippet.timeout_s = float(rest)
    else:
        raise AssertionError(f"{snippet.id}: unknown marker <!-- snippet: {marker} -->")


def snippets(path: Path) -> list[Snippet]:
    """The fenced blocks of one markdown file, each with the marker on the line right before its fence."""
    found: list[Snippet] = []
    lines = path.read_text().splitlines()
    number = 0
    while number < len(lines):
        opening = FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        fence, lang = opening.groups()
        end = number + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        previous = MARKER.match(lines[number - 1]) if number else None
        snippet = Snippet(
            path, number + 1, lang, "\n".join(lines[number + 1 : end]) + "\n", previous.group(1) if previous else None
        )
        if lang in RUN_LANGS:
            parse_marker(snippet)
            found.append(snippet)
        number = end + 1
    return found


ALL = [s for path in DOCS for s in snippets(path)]


def rewrite(code: str, port: int) -> str:
    """The test's only change to a block: the docs' Redis port becomes the test's (`redis-cli -p` too)."""
    for docs, test in ((f"127.0.0.1:{DOCS_PORT}", f"127.0.0.1:{port}"), (f"--port {DOCS_PORT}", f"--port {port}"),
                       (f"redis-cli -p {DOCS_PORT} ", f"redis-cli -p {port} ")):  # fmt: skip
        code = code.replace(docs, test)
    return code


RUNNER = '''\
"""Runs one snippet, with what a user brings in its namespace (tests/system/test_snippets.py)."""
import ast
import sys

namespace = {"__name__": "__main__"}
code = open(sys.argv[1]).read()
names = {node.id for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Name)}
if names & {"model", "train_step"}:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained("./tiny")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def train_step(*args):
        """A real step: the completion tokens' cross-entropy (a batch's `to_arrays()`, else a short sequence)."""
        arrays = next((a for a in args if isinstance(a, dict)), None)
        if arrays is None:
            arrays = {"input_ids": np.arange(1, 9)[None], "attention_mask": np.ones((1, 8), np.int64),
                      "loss_mask": np.ones((1, 8), np.int64)}
        ids = torch.from_numpy(np.asarray(arrays["input_ids"], np.int64))
        attention = torch.from_numpy(np.asarray(arrays["attention_mask"], np.int64))
        mask = torch.from_numpy(np.asarray(arrays["loss_mask"], np.float32))[:, 1:]
        logits = model(ids, attention_mask=attention).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (nll * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"train_step: loss {loss.item():.4f} over {int(mask.sum())} tokens of {ids.shape[0]} samples", flush=True)
        return loss.item()

    namespace.update(model=model, train_step=train_step)
exec(compile(code, sys.argv[2], "exec"), namespace)
print("SNIPPET-DONE", flush=True)
'''


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(binary=find_redis_server()) as running:
        yield running


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from consumers.engines.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("snippets-tiny"), seed=0)


@contextlib.contextmanager
def docs_worker(
    server: RedisServer, tiny: Path, logs: Path, gateway_port: int | None = None, ns: str = DOCS_NS
) -> Iterator[None]:
    """A fresh pipeline: the server flushed, then one torch worker on `ns` (and a gateway on `gateway_port`, started
    beside it), stopped at the end. Each block gets its own: admission counts every sample ever submitted on a
    namespace, so blocks sharing one would hold each other back (the README trainer's 256 samples use up the
    capacity the trainer guide's admission block starts with)."""
    with redis.Redis.from_url(server.url) as client:
        client.flushall()
        worker = start_worker(server.url, ns, tiny, "snippets", "--engine", "torch", log_file=logs / "worker.log")
        services = [worker]
        try:
            if gateway_port is not None:
                services.append(start_gateway(server, tiny, gateway_port, logs / "gateway.log"))
            wait_for_worker(client, ns, "snippets", worker, timeout_s=90)
            if gateway_port is not None:
                wait_listening(services[1], gateway_port, logs / "gateway.log")
            yield
        finally:
            stop_processes(services)


@pytest.fixture(scope="module")
def recording(server: RedisServer, tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`runs/` holding `runs/exp1`: a run of 16 prompts of 4 samples on `exp1` recorded by `rollouts record`, as the
    recording guide's first block does, for the blocks that read it (the trainer collects the run meanwhile)."""
    runs = tmp_path_factory.mktemp("snippets-runs")
    with docs_worker(server, tiny, runs.parent):
        yield make_recording(server, tiny, runs)


def make_recording(server: RedisServer, tiny: Path, runs: Path) -> Path:
    from pipeline.wire import Keys
    from producers.client import RolloutClient

    recorder = start_command(
        "record",
        "--redis",
        server.url,
        "--ns",
        DOCS_NS,
        "--to",
        str(runs / "exp1"),
        log_file=runs.parent / "recorder.log",
    )
    client = RolloutClient(server.url, DOCS_NS, tokenizer=tiny)
    try:
        for i in range(16):
            client.submit(f"what is {i} + {i}?", n=4, max_tokens=16, meta={"answer": 2 * i})
        assert len(client.collect(16, timeout=120)) == 16
        stream = Keys(DOCS_NS).rollouts

        def recorded() -> bool:
            last = client.streams.redis.xinfo_stream(stream)["last-generated-id"]
            groups = {g["name"]: g for g in client.streams.redis.xinfo_groups(stream)}
            return b"recorder" in groups and groups[b"recorder"]["last-delivered-id"] == last

        def recorded_or_exited() -> bool:
            assert recorder.poll() is None, (runs.parent / "recorder.log").read_text()
            return recorded()

        wait_until(recorded_or_exited, 60, "the recorder to read every rollout")
    finally:
        recorder.send_signal(signal.SIGINT)
        recorder.wait(timeout=60)
    assert list((runs / "exp1").glob("*.parquet")), (runs.parent / "recorder.log").read_text()
    return runs


def workdir(tmp_path: Path, tiny: Path | None) -> Path:
    """A fresh cwd that looks like a checkout's root to the snippet: `examples/` (and `./tiny` for python)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "examples").symlink_to(ROOT / "examples")
    if tiny is not None:
        (cwd / "tiny").symlink_to(tiny)
    return cwd


def environment(snippet: Snippet) -> dict[str, str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # nothing is downloaded (datasets reads files)
    return {**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **offline, **snippet.env}


def wait_for(process: subprocess.Popen[bytes], timeout_s: float, what: str, log: Path) -> int:
    """The process's exit code; a hang past the deadline fails, with what it printed."""
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        pytest.fail(f"{what} hung: still running after {timeout_s:.0f}s; it printed:\n{log.read_text()[-4000:]}")


def stop_group(pgid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM to a process group (a bash block's `&` jobs), SIGKILL if any member is left at the deadline."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return

    def gone() -> bool:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False

    with contextlib.suppress(AssertionError):
        wait_until(gone, timeout_s, f"process group {pgid} to end")
        return
    os.killpg(pgid, signal.SIGKILL)


def start_gateway(server: RedisServer, tiny: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`rollouts gateway` on namespace `exp1`, serving the tiny model as `policy` (the gateway guide's names)."""
    args = ["gateway", "--redis", server.url, "--ns", DOCS_NS, "--model", str(tiny), "--port", str(port)]
    return start_command(*args, "--served-model-name", "policy", "--log-level", "warning", log_file=log)


def wait_listening(process: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float = 90.0) -> None:

    def listening() -> bool:
        assert process.poll() is None, f"the gateway exited: {log.read_text()}"
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout_s, f"the gateway to listen on {port}")


def run_python(
    snippet: Snippet, server: RedisServer, tiny: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> str:
    cwd = workdir(tmp_path, tiny)
    gateway_port = free_port()
    code = rewrite(snippet.code, server.port).replace(f"127.0.0.1:{GATEWAY_PORT}", f"127.0.0.1:{gateway_port}")
    uses_gateway = f"127.0.0.1:{gateway_port}" in code
    if "runs/exp1" in code:
        (cwd / "runs").symlink_to(request.getfixturevalue("recording"))
    (cwd / "snippet.py").write_text(code)
    (cwd / "runner.py").write_text(RUNNER)
    log = tmp_path / "snippet.log"
    with contextlib.ExitStack() as stack:
        if "RolloutClient(" in code or uses_gateway:
            named = CLIENT_NS.search(code)  # the namespace the snippet's client names (the README's trainer: its own)
            ns = named.group(1) if named else DOCS_NS
            stack.enter_context(docs_worker(server, tiny, tmp_path, gateway_port if uses_gateway else None, ns))
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "runner.py", "snippet.py", snippet.id],
                cwd=cwd,
                env=environment(snippet),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            rc = wait_for(process, snippet.timeout_s, snippet.id, log)
    output = log.read_text()
    assert rc == 0, f"{snippet.id} exited {rc}:\n{output[-4000:]}"
    assert "SNIPPET-DONE" in output, output[-4000:]
    return output


def run_bash(snippet: Snippet, server: RedisServer, tmp_path: Path) -> str:
    cwd = workdir(tmp_path, None)
    port = free_port() if f"redis-server --port {DOCS_PORT}" in snippet.code else server.port
    log = tmp_path / "snippet.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["bash", "-e", "-c", rewrite(snippet.code, port)],
            cwd=cwd,
            env=environment(snippet),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = wait_for(process, snippet.timeout_s, snippet.id, log)
        finally:
            stop_group(process.pid)
    output = log.read_text()
    assert rc == 0, f"{snippet.id} exited {rc}:\n{output[-4000:]}"
    left = sorted(p.name for p in cwd.glob("dump.rdb"))  # a checkout's root: a later redis-server there reloads it
    assert not left, f"{snippet.id} left {left} in its folder"
    return output


CHECKS: dict[tuple[str, str], dict[str, int]] = {
    # What a user would see, beyond exit 0: (file, the block's first line) -> text -> at least how many times.
    # Keyed by the first line rather than the line number, which moves with every edit above the block.
    ("README.md", "from producers.client import RolloutClient"): {"train_step: loss": 4, "of 64 samples": 4},
    ("README.md", 'redis-server --port 6380 --save "" &'): {
        "tiny model (seed 0) written to": 1,
        "queued": 1,
        "prompts": 1,
    },
}


@pytest.mark.parametrize("snippet", ALL, ids=[s.id for s in ALL])
def test_snippet_runs_as_written(
    snippet: Snippet, server: RedisServer, tiny: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if snippet.skip_reason is not None:
        pytest.skip(snippet.skip_reason)
    output = (
        run_python(snippet, server, tiny, tmp_path, request)
        if snippet.lang == "python"
        else run_bash(snippet, server, tmp_path)
    )
    first = next(line for line in snippet.code.splitlines() if line.strip()).split("  #")[0].strip()
    for expected, times in CHECKS.get((snippet.path.name, first), {}).items():
        wanted = f"{snippet.id}: wanted {expected!r} at least {times} times in:\n{output[-4000:]}"
        assert output.count(expected) >= times, wanted


def test_every_python_and_bash_block_runs_or_says_why_not() -> None:
    """Each block is run or carries a marker, and the count of each is what the docs hold."""
    assert ALL, "no snippets found"
    skipped = [s for s in ALL if s.skip_reason is not None]
    run = [s for s in ALL if s.skip_reason is None]
    assert run, "every block is skipped"
    for s in skipped:
        assert len(s.skip_reason or "") > len("not run: "), f"{s.id}: a marker with no reason"
        if s.marker and s.marker.startswith("covered by "):  # each of its lines is a line of a block that runs
            doc = ROOT / s.marker.removeprefix("covered by ").split()[0]
            ran = {line for o in run if o.path == doc for line in o.code.splitlines()}
            missing = [line for line in s.code.splitlines() if line.strip() and line not in ran]
            assert not missing, f"{s.id} says it is covered by a block of {doc.name} that runs, but not: {missing}"
    print(f"{len(run)} blocks run, {len(skipped)} not run:")
    for s in skipped:
        print(f"  {s.id}: {s.skip_reason}")
