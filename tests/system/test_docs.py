"""The documentation stays true to the tree: the CLI reference is what the app prints, every path and command the
docs name exists, every code name they cite is in the code (tests/code_names.py says how a name is read and
resolved), and the README stays short enough to read top to bottom."""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path

from tests.code_names import IDENT, PACKAGES, missing, missing_file

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
REPO_DIRS = ("pipeline", "producers", "consumers", "staleness", "rollouts", "examples", "benchmarks", "docs", "tests")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REPO_PATH = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(REPO_DIRS)})/[\w./-]*)")
SCRIPT_IN_CODE = re.compile(rf"\b(?:python3?|bash|sh)\s+((?:{'|'.join(REPO_DIRS)})/[\w./-]+)")
COMMAND_IN_SPAN = re.compile(r"^rollouts\s+([a-z][a-z0-9-]*)")
COMMAND_IN_CODE = re.compile(r"(?:^|&&|\||;|\$)\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*rollouts\s+([a-z][a-z0-9-]*)")
# A placeholder, not a path: NAME, SCHEME, DIR, runN, globs, braces, ellipses.
PLACEHOLDER = re.compile(r"[A-Z]{3,}|\brunN\b|[*{}<>]|\.\.\.|…")
CODE_NAME = re.compile(rf"^({IDENT}(?:\.{IDENT})*)(\(.*)?$")
"""A span that is a code name: `pipeline.streams`, `ControlStream.ring`, `Worker`, `group_advantages(rewards)`."""
OUR_DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.{IDENT})+)(\()?")
"""A dotted name rooted in one of our packages, anywhere in a span or a fenced block (`python -m benchmarks.bench`)."""
CODE_FILE = re.compile(r"^((?:[\w.-]+/)*[\w.-]+\.(?:py|lua|sh))(?:::\S+|:\d+(?:-\d+)?)?$")
"""A span that is a code file, bare or under a folder (`worker.py`, `engines/base.py`, `lua/publish.lua`)."""
FILE_SUFFIXES = ("py", "lua", "sh", "md", "json", "yaml", "toml", "txt", "so")
DATED = ROOT / "benchmarks" / "results"
"""Dated studies (append-only): they cite the code of their date and commit, so their code names are not checked
(their paths are)."""


def doc_files() -> list[Path]:
    files = [README, *sorted((ROOT / "docs").rglob("*.md"))]
    lab = ROOT / "benchmarks"
    if lab.is_dir():
        files += sorted(lab.rglob("*.md"))
    return files


def split_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, fenced code lines), each with its 1-based line number."""
    prose: list[tuple[int, str]] = []
    code: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append((number, line))
    return prose, code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    prose, _ = split_code(path.read_text())
    for _, line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def repo_path_exists(raw: str) -> bool:
    path = raw.split("::")[0].rstrip(".,:;")
    path = re.sub(r":\d+(-\d+)?$", "", path)
    return (ROOT / path).exists()


@cache
def known_commands() -> frozenset[str]:
    """Every command of `rollouts`, hidden ones included, and the lab's (registered through an entry point)."""
    import typer
    import typer.main

    from rollouts import app

    names: set[str] = set()

    def add(typer_app: typer.Typer) -> None:
        names.update(getattr(typer.main.get_command(typer_app), "commands", {}))

    try:
        lab = importlib.import_module("benchmarks.cli")
    except ModuleNotFoundError as e:
        if e.name not in ("benchmarks", "benchmarks.cli"):
            raise
    else:  # the lab's commands, as its entry point registers them (before reading `app`, in case it adds there)
        register = getattr(lab, "register", None)
        if callable(register):
            scratch = typer.Typer()
            register(scratch)
            add(scratch)
        if isinstance(getattr(lab, "app", None), typer.Typer):
            add(lab.app)
    add(app)
    return frozenset(names)


def code_name_problems(span: str, fenced: bool) -> list[str]:
    """What is wrong with the code names in one backtick span (or, `fenced`, one line of a fenced block)."""
    cited: dict[str, bool] = {}
    if not fenced:
        if m := CODE_FILE.match(span):
            file = m.group(1)
            if file.split("/")[0] not in REPO_DIRS and not PLACEHOLDER.search(file) and missing_file(file):
                return [f"no such file `{file}`"]
            return []
        if m := CODE_NAME.match(span):
            cited[m.group(1)] = m.group(2) is not None
    for m in OUR_DOTTED.finditer(span):
        cited.setdefault(m.group(1), m.group(2) is not None)
    out = []
    for name, call in cited.items():
        if name.rpartition(".")[2] in FILE_SUFFIXES:
            continue
        why = missing(name, call)
        if why:
            out.append(f"`{name}`: {why}")
    return out


MOVED = {"pipeline/cli/": "rollouts/"}
"""Folders moved since a dated study named them (the shell, now a package of its own): old prefix, new prefix."""


def moved(raw: str) -> bool:
    """A dated study's path as it stood on the study's date: `tests/test_x.py`, since grouped by package
    (`tests/staleness/test_x.py`), or a file of a folder since moved (`MOVED`)."""
    name = Path(raw).name
    if raw == f"tests/{name}" and name.startswith("test_") and any((ROOT / "tests").glob(f"*/{name}")):
        return True
    return any(raw.startswith(old) and repo_path_exists(new + raw.removeprefix(old)) for old, new in MOVED.items())


def problems_in(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    text = path.read_text()
    prose, code = split_code(text)
    out = []
    for number, line in prose:
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                out.append(f"{rel}:{number}: link to a missing file: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{rel}:{number}: link to a missing heading: {target}")
        for _, span in CODE_SPAN.findall(line):
            span = span.strip()
            for raw in REPO_PATH.findall(span):
                if PLACEHOLDER.search(raw) or repo_path_exists(raw):
                    continue
                if path.is_relative_to(DATED) and moved(raw):
                    continue
                out.append(f"{rel}:{number}: missing path `{raw}`")
            m = COMMAND_IN_SPAN.match(span)
            if m and m.group(1) not in known_commands():
                out.append(f"{rel}:{number}: no such command `rollouts {m.group(1)}`")
            if not path.is_relative_to(DATED):
                out += [f"{rel}:{number}: {p}" for p in code_name_problems(span, fenced=False)]
    for number, line in code:
        for raw in SCRIPT_IN_CODE.findall(line):
            if not PLACEHOLDER.search(raw) and not repo_path_exists(raw):
                out.append(f"{rel}:{number}: missing script {raw}")
        for name in COMMAND_IN_CODE.findall(line):
            if name not in known_commands():
                out.append(f"{rel}:{number}: no such command `rollouts {name}`")
        if not path.is_relative_to(DATED):
            out += [f"{rel}:{number}: {p}" for p in code_name_problems(line, fenced=True)]
    return out


def test_every_path_and_command_the_docs_name_exists() -> None:
    problems = [p for f in doc_files() for p in problems_in(f)]
    assert not problems, f"{len(problems)} names in the docs that the tree lacks:\n" + "\n".join(problems)


def test_the_cli_reference_is_current() -> None:
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    assert spec and spec.loader
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    current = (ROOT / "docs" / "cli.md").read_text()
    assert gen_cli.render() == current, "docs/cli.md is stale: run python docs/gen_cli.py"


def test_the_readme_stays_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines (at most 400): move the depth to docs/"
    long = [f"line {i}: {len(line)} characters" for i, line in enumerate(lines, 1) if len(line) > 400]
    assert not long, "README.md lines over 400 characters:\n" + "\n".join(long)


def test_the_code_name_check_tells_ours_from_foreign_names() -> None:
    """The check itself, on names as the docs cite them: ours that exist pass, ours that do not fail, others' pass."""
    passing = [
        "pipeline.streams",
        "consumers.engines.tiny_model.make_adapter",
        "ControlStream.ring",
        "Streams.trim_consumed",
        "RolloutClient.publish_weights(model)",
        "Rollout.model_construct",  # pydantic's, on a class of ours
        "client.settle()",  # a `RolloutClient`, by its module's short form
        "group_advantages(rewards)",
        "consumers/worker.py",  # the path check's (a folder of ours)
        "engines/base.py",
        "AsyncLLM.sleep",
        "torch.cat",
        "vllm/config/model.py",
    ]
    failing = {
        "Streams.ring": "class `Streams` has no member `ring`",
        "staleness.broadcast.groups_built()": "`staleness` has no `broadcast.groups_built`",
        "consumers.Worker": "`consumers` has no `Worker`",
        "pipeline.streams.take": "`pipeline.streams` has no `take`",
        "transports.py": "no such file `transports.py`",
        "TorchEngine.no_such_method": "class `TorchEngine` has no member `no_such_method`",
        "no_such_function()": "`no_such_function`: not in the code",
        "NoSuchClass": "`NoSuchClass`: not in the code",
    }
    wrong = {span: got for span in passing if (got := code_name_problems(span, fenced=False))}
    for span, want in failing.items():
        got = code_name_problems(span, fenced=False)
        if len(got) != 1 or want not in got[0]:
            wrong[span] = got
    assert not wrong, wrong
    fenced = code_name_problems("python -m benchmarks.no_such_tool --rounds 3", fenced=True)
    assert fenced == ["`benchmarks.no_such_tool`: `benchmarks` has no `no_such_tool`"]


def test_the_recording_guide_counts_the_columns_a_recording_has() -> None:
    """The guide's `df.shape` of a recording, and its table of columns, are those of `pipeline.recording.SCHEMA`."""
    from pipeline.recording import SCHEMA

    guide = (ROOT / "docs" / "guide" / "recording.md").read_text()
    shape = re.search(r"`df\.shape` was `\(256, (\d+)\)`", guide)
    assert shape is not None and int(shape.group(1)) == len(SCHEMA), "the recording guide's df.shape"
    tabled = {name for row in re.findall(r"^\| (`[^|]+) \|", guide, re.M) for name in re.findall(r"`(\w+)`", row)}
    assert tabled == set(SCHEMA.names), sorted(tabled ^ set(SCHEMA.names))
