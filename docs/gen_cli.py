"""Write docs/cli.md: `rollouts --help` and every user command's `--help`, as plain text 100 columns wide.

    python docs/gen_cli.py            # rewrite docs/cli.md
    python docs/gen_cli.py --check    # exit 1 if docs/cli.md differs from what the app prints now

The commands come from the typer app itself (hidden ones, the lab's among them, are left out), so the page
cannot name a command or a flag the app does not have. `tests/system/test_docs.py` regenerates it and compares.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = ROOT / "docs" / "cli.md"
WIDTH = 100

HEADER = """# CLI reference

This page lists `rollouts --help` and the `--help` of every user command, as the app prints them. It is
generated: `python docs/gen_cli.py` rewrites it, and `tests/system/test_docs.py` fails when it is stale. The lab's
commands (`rollouts bench`, `bench-sync`, `soak`, `scale`, `chaos`, ...) are not the product's: installed from a
checkout (`pip install -e ./benchmarks`), they are hidden from `rollouts --help`, `rollouts-bench --help` lists them,
and [benchmarks.md](benchmarks.md) says what each one measures.

`--redis` and `--ns` also come from `ROLLOUTS_REDIS` and `ROLLOUTS_NS`. A wrong URL, a missing model, a bad file
or a Redis older than 6.2 gives one line that says what to fix and exit code 2.
"""


def _render_here() -> str:
    """Render every help text in this process (the environment must already fix the width and colour)."""
    import typer.main
    from typer.testing import CliRunner

    from rollouts import app

    group = typer.main.get_command(app)
    runner = CliRunner()

    def help_of(args: list[str]) -> str:
        result = runner.invoke(app, [*args, "--help"], prog_name="rollouts", terminal_width=WIDTH)
        if result.exit_code != 0:
            raise RuntimeError(f"rollouts {' '.join(args)} --help exited {result.exit_code}: {result.output}")
        return "\n".join(line.rstrip() for line in result.output.strip("\n").splitlines())

    commands = getattr(group, "commands", {})  # in the order the app registered them, as `rollouts --help` lists
    names = [name for name, command in commands.items() if not command.hidden]
    parts = [HEADER, "## `rollouts`\n", "```text", help_of([]), "```\n"]
    for name in names:
        parts += [f"## `rollouts {name}`\n", "```text", help_of([name]), "```\n"]
    return "\n".join(parts).rstrip("\n") + "\n"


def render() -> str:
    """The page as the app prints it now, rendered in a child process with a fixed width and no colour."""
    forcing = ("FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "CLICOLOR_FORCE")  # would turn colour on
    # ROLLOUTS_*: options read them as defaults, and the page must not depend on who generates it.
    env = {k: v for k, v in os.environ.items() if k not in forcing and not k.startswith("ROLLOUTS_")}
    env.update(
        COLUMNS=str(WIDTH),
        TERMINAL_WIDTH=str(WIDTH),
        LINES="50",
        TERM="dumb",
        TYPER_USE_RICH="0",  # click's own plain formatter: no boxes, no colour
        NO_COLOR="1",
        _TYPER_FORCE_DISABLE_TERMINAL="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--render-here"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def main(argv: list[str]) -> int:
    if argv[:1] == ["--render-here"]:
        sys.stdout.write(_render_here())
        return 0
    text = render()
    if argv[:1] == ["--check"]:
        if TARGET.read_text() != text:
            print("docs/cli.md is stale: run python docs/gen_cli.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
