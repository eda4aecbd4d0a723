"""Prompts from a JSONL file, as `rollouts submit --file` reads them.

A file is checked whole before anything is queued, and every bad line is reported with
its number, so that a person fixes the file once rather than one error at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.wire import MAX_SAMPLES, SAMPLING_KNOBS, Prompt, Sampling, knobs_given
from producers.client import RolloutClient


class PromptLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    prompt: str | None = None
    tokens: list[int] | None = None
    n: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    top_k: int | None = None
    """The knobs of `pipeline.wire.SAMPLING_KNOBS`: left out (or null), the wire's default (off)."""
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    meta: dict = Field(default_factory=dict)
    chat: bool = True
    reward_fn: str | None = None
    adapter: str | None = None


def read_prompts_file(path: Path, client: RolloutClient) -> list[Prompt]:
    """Parse and check every line; raise `ValueError` listing each bad line if any is bad."""
    prompts: list[Prompt] = []
    problems: list[str] = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):  # one bad byte spoils one line only
        if not raw.strip():
            continue
        try:
            line = PromptLine.model_validate(json.loads(raw.decode()))
            sampling = Sampling(
                max_tokens=line.max_tokens,
                temperature=line.temperature,
                top_p=line.top_p,
                stop_token_ids=line.stop_token_ids,
                seed=line.seed,
                **knobs_given(**{name: getattr(line, name) for name in SAMPLING_KNOBS}),
            )
            prompts.append(
                client.make_prompt(
                    line.prompt,
                    tokens=line.tokens,
                    n=line.n,
                    sampling=sampling,
                    meta=line.meta,
                    id=line.id,
                    chat=line.chat,
                    reward_fn=line.reward_fn,
                    adapter=line.adapter,
                )
            )
        except UnicodeDecodeError:
            problems.append(f"line {number}: not UTF-8 text")
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON ({exc.msg})")
        except RecursionError:
            problems.append(f"line {number}: not JSON (nested too deep)")
        except ValidationError as exc:
            detail = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in exc.errors())
            problems.append(f"line {number}: {detail}")
        except ValueError as exc:
            problems.append(f"line {number}: {exc}")
    if problems:
        raise ValueError(f"{path} has {len(problems)} bad lines, nothing was queued:\n  " + "\n  ".join(problems))
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts
