"""The documentation stays true to the tree: the CLI reference is what the app prints, every path and command the
docs name exists, and the README stays short enough to read top to bottom."""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
REPO_DIRS = ("pipeline", "producers", "consumers", "staleness", "examples", "benchmarks", "docs", "tests")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REPO_PATH = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(REPO_DIRS)})/[\w./-]*)")
SCRIPT_IN_CODE = re.compile(rf"\b(?:python3?|bash|sh)\s+((?:{'|'.join(REPO_DIRS)})/[\w./-]+)")
COMMAND_IN_SPAN = re.compile(r"^rollouts\s+([a-z][a-z0-9-]*)")
COMMAND_IN_CODE = re.compile(r"(?:^|&&|\||;|\$)\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*rollouts\s+([a-z][a-z0-9-]*)")
# A placeholder, not a path: NAME, SCHEME, DIR, runN, globs, braces, ellipses.
PLACEHOLDER = re.compile(r"[A-Z]{3,}|\brunN\b|[*{}<>]|\.\.\.|…")


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

    from pipeline.cli import app

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
                if not PLACEHOLDER.search(raw) and not repo_path_exists(raw):
                    out.append(f"{rel}:{number}: missing path `{raw}`")
            m = COMMAND_IN_SPAN.match(span)
            if m and m.group(1) not in known_commands():
                out.append(f"{rel}:{number}: no such command `rollouts {m.group(1)}`")
    for number, line in code:
        for raw in SCRIPT_IN_CODE.findall(line):
            if not PLACEHOLDER.search(raw) and not repo_path_exists(raw):
                out.append(f"{rel}:{number}: missing script {raw}")
        for name in COMMAND_IN_CODE.findall(line):
            if name not in known_commands():
                out.append(f"{rel}:{number}: no such command `rollouts {name}`")
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
