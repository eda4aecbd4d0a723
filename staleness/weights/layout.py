"""What the workers' models take (`ModelLayout`: each tensor's name and shape, and which names are tied), so that a
trainer refuses weights that fit none of them **while it streams them, before any worker pauses**: a wrong name or
shape then costs nothing (no sync begins, every worker keeps serving the version it has), where a worker that found
it at load time would stop (a failed load stops a worker: it must not serve the old version as the new one).

Each worker advertises its model's layout once its engine started: the JSON below under its digest in the hash
`{ns}:layouts` (`HSETNX`: one entry per distinct model, however many workers serve it) and the digest in its
heartbeat's `layout` field. `publish_weights` reads the live workers' digests and layouts (`fleet_layouts`, two round
trips) and checks each `(name, tensor)` as it passes (`LayoutCheck.wrap`), and at the end that nothing is missing.
A worker whose engine cannot say (the `synthetic` and `remote` engines, an older worker, one not started yet) is not
checked here: it still checks what it loads itself.

JSON (`ModelLayout.to_json`): `{"v": 1, "shapes": {name: [dims]}, "tied": [[name, ...], ...]}`, keys sorted.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.streams import Streams

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LAYOUT_FIELD = "layout"
"""The heartbeat field that holds the digest of the worker's model layout (its JSON is in `{ns}:layouts`)."""
LAYOUT_V = 1


class WeightsMismatch(ValueError):
    """Weights that fit none of the live workers' models: nothing was published, no worker paused."""


@dataclass(frozen=True)
class ModelLayout:
    """The tensors a model takes: name -> shape, and the groups of names tied to one storage (loading one name of a
    group loads them all: `lm_head.weight` = `model.embed_tokens.weight`)."""

    shapes: dict[str, tuple[int, ...]]
    tied: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def of(cls, shapes: Mapping[str, Iterable[int]], storage: Mapping[str, int] | None = None) -> ModelLayout:
        """From names and shapes, and each name's storage (names of one storage are tied), as an engine knows them."""
        groups: dict[int, list[str]] = {}
        for name, key in (storage or {}).items():
            groups.setdefault(key, []).append(name)
        tied = tuple(sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1))
        return cls({k: tuple(int(d) for d in v) for k, v in shapes.items()}, tied)

    def to_json(self) -> str:
        data = {"v": LAYOUT_V, "shapes": {k: list(self.shapes[k]) for k in sorted(self.shapes)}, "tied": self.tied}
        return json.dumps(data, separators=(",", ":"), sort_keys=True)

    @property
    def digest(self) -> str:
        """The same model gives the same digest in every worker (the JSON is canonical)."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:20]

    @classmethod
    def from_json(cls, raw: bytes | str) -> ModelLayout:
        """`ValueError` says what is malformed."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("v") != LAYOUT_V:
                raise ValueError(f"not a layout of v={LAYOUT_V}")
            shapes = {str(k): tuple(int(d) for d in v) for k, v in data["shapes"].items()}
            tied = tuple(tuple(str(n) for n in group) for group in data.get("tied", ()))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"malformed model layout: {exc}") from None
        return cls(shapes, tied)

    def representatives(self) -> dict[str, str]:
        """Each name -> the first name of its tied group (itself when untied): what `missing` counts by."""
        first = {name: name for name in self.shapes}
        for group in self.tied:
            for name in group:
                first[name] = group[0]
        return first


@dataclass
class _Fit:
    layout: ModelLayout
    workers: int
    problem: str | None = None
    loaded: set[str] = field(default_factory=set)
    """Representatives of the groups seen so far."""


class LayoutCheck:
    """Checks a stream of named tensors against the live workers' layouts, tensor by tensor: it raises
    `WeightsMismatch` at the first tensor that fits none of them (a name none takes, or a shape none has), and at
    the end if every one still lacks tensors. A fleet of two models (a misconfiguration) passes what fits either:
    the workers it does not fit then refuse it themselves, as before."""

    def __init__(self, layouts: Iterable[tuple[ModelLayout, int]]) -> None:
        """`layouts`: each model of the fleet and how many workers serve it (`fleet_layouts`)."""
        self._fits = [_Fit(layout, workers) for layout, workers in sorted(layouts, key=lambda lw: -lw[1])]
        self._first = {id(fit): fit.layout.representatives() for fit in self._fits}
        self.checked = 0
        """Tensors checked so far."""

    def __bool__(self) -> bool:
        return bool(self._fits)

    def see(self, name: str, shape: tuple[int, ...]) -> None:
        """Check one tensor; `WeightsMismatch` once no layout fits what was seen."""
        self.checked += 1
        for fit in self._fits:
            if fit.problem is not None:
                continue
            expected = fit.layout.shapes.get(name)
            if expected is None:
                close = difflib.get_close_matches(name, list(fit.layout.shapes), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                fit.problem = (
                    f"tensor {name!r} is not in the workers' model{hint}: publish the names of the model's "
                    "state_dict(), without wrapper prefixes such as 'module.', '_orig_mod.' or '_fsdp_wrapped_module.'"
                )
            elif tuple(shape) != expected:
                fit.problem = (
                    f"tensor {name!r} has shape {tuple(shape)}, the workers' model takes {expected}: publish each "
                    "tensor whole (gathered from its shards), not one rank's shard"
                )
            else:
                fit.loaded.add(self._first[id(fit)][name])
        self._raise_if_none_fits()

    def finish(self) -> None:
        """After the last tensor: `WeightsMismatch` if every layout still lacks some."""
        for fit in self._fits:
            if fit.problem is None:
                missing = sorted(set(self._first[id(fit)].values()) - fit.loaded)
                if missing:
                    shown = ", ".join(repr(m) for m in missing[:3]) + (", ..." if len(missing) > 3 else "")
                    fit.problem = (
                        f"the weights lack {len(missing)} of the {len(fit.layout.shapes)} tensors the workers' model "
                        f"takes ({shown}): publish every parameter and buffer of the model"
                    )
        self._raise_if_none_fits()

    def _raise_if_none_fits(self) -> None:
        if self._fits and all(fit.problem is not None for fit in self._fits):
            first = self._fits[0]
            others = ""
            if len(self._fits) > 1:
                others = f" (and fits none of the {len(self._fits) - 1} other models in the fleet)"
            raise WeightsMismatch(f"{first.problem}{others}")

    def wrap(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass `stream` through, checking each tensor before it is handed on, and the whole at its end. A refusal
        closes `stream` (a generator's cleanup runs, and it lets go of what it holds)."""
        try:
            for name, tensor in stream:
                shape = tuple(tensor.shape)
                try:
                    self.see(name, shape)
                except WeightsMismatch:
                    del tensor  # not kept alive by the traceback
                    raise
                yield name, tensor
                del tensor
            self.finish()
        finally:
            close = getattr(stream, "close", None)
            if callable(close):
                close()


def fleet_layouts(streams: Streams) -> list[tuple[ModelLayout, int]]:
    """The layouts of the live workers that advertise one, each with how many workers serve it. A layout that cannot
    be read is left out (logged): it must not stop a publish."""
    digests = Counter(d for d in streams.registry.live_workers_with(LAYOUT_FIELD).values() if d)
    if not digests:
        return []
    names = sorted(digests)
    raws = streams.redis.hmget(streams.keys.layouts, names)
    found: list[tuple[ModelLayout, int]] = []
    for digest, raw in zip(names, raws, strict=True):
        if raw is None:
            log.warning("layout %s of %d worker(s) is not in %s", digest, digests[digest], streams.keys.layouts)
            continue
        try:
            layout = ModelLayout.from_json(raw)
        except ValueError as exc:
            log.warning("layout %s in %s: %s", digest, streams.keys.layouts, exc)
            continue
        found.append((layout, digests[digest]))
    return found


def advertise(streams: Streams, layout: ModelLayout) -> str:
    """Store a worker's layout under its digest in `{ns}:layouts` (once per distinct model); returns the digest, for
    its heartbeat's `layout` field."""
    digest = layout.digest
    streams.redis.hsetnx(streams.keys.layouts, digest, layout.to_json())
    return digest


def layout_of(engine: Any) -> ModelLayout | None:
    """The layout of an engine's model, if it can say (`weight_layout()`: an object with `shapes` and `storage`, or
    None), else None."""
    method = getattr(engine, "weight_layout", None)
    if not callable(method):
        return None
    found = method()
    if found is None:
        return None
    if isinstance(found, ModelLayout):
        return found
    return ModelLayout.of(found.shapes, getattr(found, "storage", None))
