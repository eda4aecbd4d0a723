"""verifiers (Prime Intellect's environment library, what prime-rl trains with) as a rollout source: its environments
run against a Rollout Streams fleet through verifiers' own train client, and their traces reach `RolloutClient` as
whole groups.

    from producers.client import RolloutClient
    from producers.integrations.verifiers import VerifiersRollouts

    client = RolloutClient("redis://HOST:6379/0", "exp1")
    async with VerifiersRollouts(client, env, gateway="http://GATEWAY:8000", model="qwen",
                                 renderer_model="Qwen/Qwen3-0.6B", sampling={"max_tokens": 512}) as source:
        await source.run(tasks, group_size=8)        # each task's 8 episodes, published as one group
    for group in client.groups(timeout=60): ...      # the trainer's side, as for any prompt

`env` is a verifiers `Env` (`vf.load_environment(config)`, or an `Env` subclass built from its config: tested with
verifiers 0.4.0's `SingleAgentEnv` and its `user-sim` env). Its agents' calls go through verifiers' `TrainClient`
(`client.type train` in `vf-eval` terms, renderers' client, as prime-rl runs it): the prompt is rendered to token ids
here, with `renderer_model`'s chat template, and `POST /inference/v1/generate` on the gateway (`rollouts gateway`)
answers token ids and logprobs; verifiers builds each trace from those. A task's `group_size` episodes become one
group on `{ns}:rollouts`, published at once when the last one ends:

- one rollout per trainable branch of each trace that ended without an error, in an episode the environment accepts
  (`Env.complete`: by default, every trace of it ok). verifiers makes one branch per root-to-leaf path of the
  conversation: one for a conversation its renderer carries from turn to turn, one per turn where it renders each
  turn anew, as its default renderer does. Each has `prompt_tokens` up to the first token the model wrote, then
  `tokens` with `mask` (the ranges the model wrote; the template's and the user's tokens between turns are not),
  `logprobs` (the engine's, raw: 0 where the model did not write), per-token `spans` (each reply's versions as the
  gateway answered them; tokens between replies carry the version of the reply before them) and `reward` (the
  trace's, verifiers' weighted sum of its rewards; each reward and metric is in `meta`);
- the traces of agents the environment marks untrainable (`user-sim`'s simulated user: its calls run on the fleet too)
  and traces that failed (a `HarnessError`, a provider error: their reason is in the `GroupReport`) are left out, and
  `n` counts what is published; a group with nothing left is not published;
- every trace's gateway session (verifiers sends its trace id as `X-Session-ID`, so each trace's calls stay on one
  worker's prefix cache) is released (`POST /finish_session`) as soon as its episode ends, the untrainable ones too.

The per-token versions: verifiers keeps only token ids and logprobs of an answer, so its calls go through a local hop
(`127.0.0.1`, an `aiohttp` server in this process) that forwards them to the gateway unchanged and keeps each reply's
`spans` until its group is published.

verifiers is optional (`pip install 'rollout-streams[verifiers]'`: it pins `openai<3`); this module imports it when a
`VerifiersRollouts` is made. docs/guide/verifiers.md says more.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from pipeline.install import pip_install
from pipeline.wire import MAX_SAMPLES, Rollout, Span
from producers.client import RolloutClient
from staleness.admission import Admission

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger(__name__)

TESTED_VERIFIERS = "0.4.0"
"""The verifiers release this module is tested against (with renderers 0.1.12: the `verifiers` extra)."""
GENERATE = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}
"""Request headers the local hop does not pass on (its own connection's)."""


def import_verifiers() -> Any:
    """`verifiers.v1`, or an `ImportError` of one line saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            f"producers.integrations.verifiers needs verifiers ({exc.name or exc} is missing): "
            f"{pip_install('verifiers')} "
            f"(verifiers {TESTED_VERIFIERS}, renderers 0.1.12; they pin openai<3)"
        ) from None
    return vf


class VersionsUnknown(RuntimeError):
    """A trace holds tokens the model wrote that no reply of its session had: their versions cannot be told."""


@dataclass
class Reply:
    """One answer of the gateway's generate route, as the local hop kept it."""

    tokens: tuple[int, ...]
    spans: list[Span]


class ReplyRecorder:
    """A local HTTP hop between verifiers' train client and the gateway: it forwards every call unchanged and keeps,
    per session (`X-Session-ID`, verifiers' trace id), each generated reply's token ids and version spans."""

    def __init__(self, gateway: str, timeout_s: float | None = None) -> None:
        self.gateway = gateway.rstrip("/").removesuffix("/v1")
        self.timeout_s = timeout_s
        self.replies: dict[str, list[Reply]] = {}
        self.url = ""
        """The hop's base URL (`http://127.0.0.1:PORT`), once started."""
        self._http: httpx.AsyncClient | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        from aiohttp import web

        self._http = httpx.AsyncClient(
            base_url=self.gateway,
            timeout=httpx.Timeout(self.timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _forward(self, request: web.Request) -> web.Response:
        from aiohttp import web

        assert self._http is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            answer = await self._http.request(
                request.method, request.path_qs, content=await request.read(), headers=headers
            )
        except httpx.HTTPError as exc:
            message = f"the gateway at {self.gateway} did not answer: {type(exc).__name__}: {exc}"
            return web.json_response({"error": {"message": message, "type": "bad_gateway"}}, status=502)
        session = request.headers.get(SESSION_HEADER)
        if request.path == GENERATE and answer.status_code == 200 and session:
            try:
                self._record(session, answer.json())
            except (ValueError, TypeError, AttributeError) as exc:  # not vLLM's answer: verifiers will say so
                log.warning("an answer of the gateway's generate route that is not vLLM's: %s", exc)
        content_type = answer.headers.get("content-type", "application/json")
        return web.Response(status=answer.status_code, body=answer.content, headers={"Content-Type": content_type})

    def _record(self, session: str, body: dict[str, Any]) -> None:
        kept = self.replies.setdefault(session, [])
        for choice in body.get("choices") or []:
            spans = [(int(v), int(s), int(e)) for v, s, e in choice.get("spans") or []]
            kept.append(Reply(tuple(int(t) for t in choice.get("token_ids") or []), spans))

    def forget(self, sessions: Iterable[str]) -> None:
        for session in sessions:
            self.replies.pop(session, None)


@dataclass
class GroupReport:
    """What one task's group of episodes gave."""

    prompt_id: str
    """The group's id on `{ns}:rollouts` (its rollouts' `prompt_id`)."""
    task: str
    """The task's key (verifiers' `Task.key`)."""
    episodes: list[Any] = field(default_factory=list)
    """verifiers' `Episode`s, each with its traces (what `vf-eval` saves), the untrainable and failed ones too."""
    rollout_ids: list[str] = field(default_factory=list)
    """The rollouts published (none when every trace failed)."""
    rewards: list[float] = field(default_factory=list)
    published: int = 0
    """How many of `rollout_ids` were new on `{ns}:rollouts` (a repeated id is skipped there)."""
    failed: list[str] = field(default_factory=list)
    """Why each failed trace or episode was left out (`trace ID (AGENT): error`, `episode ID: error`)."""
    untrainable: int = 0
    """Traces of agents the environment does not train (a simulated user), left out."""
    released: int = 0
    """Gateway sessions released when their episode ended (`POST /finish_session` for every trace, trainable or not;
    a trace that made no call had no pin)."""
    wall_s: float = 0.0


class VerifiersRollouts:
    """Run a verifiers environment's episodes on a Rollout Streams fleet and publish their traces as whole groups.

    `client`: a `RolloutClient` of the namespace the gateway serves (its streams receive the groups; any reader of the
    namespace, this client or the trainer's, gets them from `groups`/`batches`/`collect`). `env`: a verifiers `Env`.
    `gateway`: the `rollouts gateway` URL (with or without `/v1`). `model`: the model name the gateway serves
    (`--served-model-name`). `renderer_model`: the tokenizer and chat template to render prompts with (a local folder
    or a Hugging Face name: the model the workers serve; verifiers falls back to `model`). `renderer`: a
    `renderers.RendererConfig` (None: renderers picks one for the model, else its default, which renders no tools).
    `sampling`: verifiers' sampling values (`max_tokens`, `temperature`, `top_p`, ...; a field the gateway does not
    honour is refused with its reason). `adapter`: a LoRA adapter the gateway serves (published in the namespace) to
    generate with instead of `model`; the rollouts name it, and their versions are its own. `max_concurrent`:
    episodes in flight at once (None: no bound). `timeout_s`: how long one call may wait for its answer (None: no
    limit). `run`: the prefix of the groups' ids (default: random)."""

    def __init__(
        self,
        client: RolloutClient,
        env: Any,
        *,
        gateway: str,
        model: str,
        renderer_model: str | Path | None = None,
        renderer: Any = None,
        sampling: dict[str, Any] | None = None,
        max_concurrent: int | None = None,
        timeout_s: float | None = None,
        adapter: str | None = None,
        run: str | None = None,
    ) -> None:
        vf = import_verifiers()
        self.client, self.env, self.model, self.adapter = client, env, model, adapter
        self.recorder = ReplyRecorder(gateway, timeout_s)
        self._renderer_model = str(renderer_model) if renderer_model is not None else None
        self._renderer = renderer
        self._sampling = vf.Sampling(**(sampling or {}))
        self._vf = vf
        self._ctx: Any = None
        self._semaphore = asyncio.Semaphore(max_concurrent) if max_concurrent else None
        self._serving: Any = None
        self._gateway_http: httpx.AsyncClient | None = None
        self.run_id = run or uuid.uuid4().hex[:12]
        self._groups = 0

    async def __aenter__(self) -> VerifiersRollouts:
        vf = self._vf
        url = await self.recorder.start()
        try:
            config = vf.TrainClientConfig(
                base_url=f"{url}/v1",
                api_key_var="ROLLOUTS_GATEWAY_API_KEY",  # not PRIME_API_KEY: no Prime key goes to the gateway
                renderer_model_name=self._renderer_model,
                renderer=self._renderer,
            )
            self._ctx = vf.ModelContext(model=self.adapter or self.model, client=config, sampling=self._sampling)
            self._gateway_http = httpx.AsyncClient(base_url=self.recorder.gateway, timeout=30.0)
            self._serving = self.env.serving()
            await self._serving.__aenter__()
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self._serving is not None:
                await self._serving.__aexit__(kind, exc, tb)
        finally:
            self._serving = None
            await self._close()

    async def _close(self) -> None:
        await self.recorder.stop()
        if self._gateway_http is not None:
            await self._gateway_http.aclose()
            self._gateway_http = None

    # -- running ---------------------------------------------------------------------------------

    async def run(self, tasks: Iterable[Any], group_size: int, max_groups: int | None = None) -> list[GroupReport]:
        """Run `group_size` episodes of each task (its group), groups side by side (at most `max_groups` at once;
        `max_concurrent` bounds the episodes), each published as soon as it is whole; the groups' reports in task
        order."""
        gate = asyncio.Semaphore(max_groups) if max_groups else None

        async def one(task: Any) -> GroupReport:
            if gate is None:
                return await self.run_group(task, group_size)
            async with gate:
                return await self.run_group(task, group_size)

        return list(await asyncio.gather(*(one(task) for task in tasks)))

    async def run_group(self, task: Any, n: int, prompt_id: str | None = None) -> GroupReport:
        """Run `n` episodes of `task` and publish their trainable traces as one group (`prompt_id`: default this run's
        prefix and a counter)."""
        if self._ctx is None:
            raise RuntimeError("use `async with VerifiersRollouts(...) as source:` before running episodes")
        if not 1 <= n <= MAX_SAMPLES:
            raise ValueError(f"n={n}: a group has 1 to {MAX_SAMPLES} episodes")
        if prompt_id is None:
            prompt_id = f"vf-{self.run_id}-{self._groups}"
            self._groups += 1
        started = time.monotonic()
        report = GroupReport(prompt_id=prompt_id, task=str(task.key))
        sessions: list[str] = []
        try:
            slots = self.env.slots(task, n)
            report.episodes = list(await asyncio.gather(*(self._episode(slot, sessions, report) for slot in slots)))
            rollouts = self._rollouts(report.episodes, prompt_id, report)
            if rollouts:
                report.published = await asyncio.to_thread(self.client.streams.writer.add_rollouts, rollouts)
                if report.published:  # entered `{ns}:rollouts` without a prompt: counted as the gateway's sessions are
                    await asyncio.to_thread(self._admission().count, report.published)
                report.rollout_ids = [r.id for r in rollouts]
                report.rewards = [float(r.reward or 0.0) for r in rollouts]
        finally:
            self.recorder.forget(sessions)
        report.wall_s = time.monotonic() - started
        if report.failed:
            log.warning("group %s: %d trace(s) failed and were left out: %s", prompt_id, len(report.failed),
                        "; ".join(report.failed[:3]))  # fmt: skip
        return report

    def _admission(self) -> Admission:
        return Admission(self.client.streams.redis, self.client.streams.keys, adapter=self.adapter)

    async def _episode(self, slot: Any, sessions: list[str], report: GroupReport) -> Any:
        minted: list[str] = []

        def on_trace(trace: Any) -> None:
            minted.append(trace.id)
            sessions.append(trace.id)

        try:
            return await self.env.run_slot(slot, self._ctx, self._semaphore, on_trace=on_trace)
        finally:  # the episode's traces ended (or were abandoned): their workers no longer hold their prefixes
            report.released += await self._release(minted)

    async def _release(self, sessions: Sequence[str]) -> int:
        """`POST /finish_session` for each session (best effort: a pin left behind expires by itself); how many had a
        pin to release (a trace that made no call has none)."""
        assert self._gateway_http is not None
        http = self._gateway_http

        async def one(session: str) -> bool:
            try:
                answer = await http.post("/finish_session", params={"session_id": session})
            except httpx.HTTPError as exc:
                log.warning("releasing gateway session %s: %s", session, exc)
                return False
            if answer.status_code != 200:
                log.warning("releasing gateway session %s: %d %s", session, answer.status_code, answer.text[:200])
                return False
            return bool(answer.json().get("released"))

        return sum(await asyncio.gather(*(one(s) for s in sessions)))

    # -- traces to rollouts ------------------------------------------------------------------------

    def _rollouts(self, episodes: Sequence[Any], prompt_id: str, report: GroupReport) -> list[Rollout]:
        """The group's rollouts: one per trainable branch of each trainable trace of a complete episode."""
        drafts: list[dict[str, Any]] = []
        for episode in episodes:
            report.untrainable += sum(not trace.agent.trainable for trace in episode.traces)
            complete = self.env.complete(episode)  # the env's verdict (default: every trace ok), as --resume keeps it
            if not complete:
                report.failed += [f"episode {episode.id}: {e.type}: {e.message[:300]}" for e in episode.errors]
            for trace in episode.traces:
                if not trace.ok:
                    error = trace.last_error
                    why = f"{error.type}: {error.message[:300]}" if error else trace.stop_condition or "not ok"
                    report.failed.append(f"trace {trace.id} ({trace.agent.name}): {why}")
                if complete and trace.ok and trace.agent.trainable:
                    try:
                        drafts += self._trace_drafts(episode, trace, report.task)
                    except VersionsUnknown as exc:
                        report.failed.append(f"trace {trace.id} ({trace.agent.name}): {exc}")
        if len(drafts) > MAX_SAMPLES:
            raise ValueError(f"group {prompt_id}: {len(drafts)} samples, more than a group holds ({MAX_SAMPLES})")
        finished = time.time()
        for draft in drafts:
            draft["timing"]["finished"] = finished
        return [
            Rollout(**draft, prompt_id=prompt_id, sample=k, n=len(drafts), adapter=self.adapter)
            for k, draft in enumerate(drafts)
        ]

    def _trace_drafts(self, episode: Any, trace: Any, task: str) -> list[dict[str, Any]]:
        """A trace's rollouts but for their place in its group: one per trainable branch with tokens the model wrote."""
        branches = [b for b in trace.branches if b.trainable and any(b.sampled_mask)]
        replies = self.recorder.replies.get(trace.id, [])
        drafts = []
        for k, branch in enumerate(branches):
            meta = {
                "source": "verifiers",
                "env": episode.env.id,
                "task": task,
                "episode": episode.id,
                "trace": trace.id,
                "agent": trace.agent.name,
                "branch": k,
                "branches": len(branches),
                "turns": trace.num_turns,
                "stop": trace.stop_condition,
                "rewards": {name: r.value for name, r in trace.rewards.items() if r is not None},
                "metrics": {name: v for name, v in trace.metrics.items() if v is not None},
            }
            fields = branch_fields(branch, replies, trace.id)
            fields.update(meta=meta, reward=float(trace.reward), timing={"started": trace.timing.start})
            drafts.append(fields)
        return drafts


def branch_fields(branch: Any, replies: Sequence[Reply], session: str) -> dict[str, Any]:
    """A verifiers `Branch` (its `token_ids`, `sampled_mask`, `logprobs`) as a rollout's fields but for its group's
    (`prompt_id`, `sample`, `n`), `meta` and `reward`: the versions of its sampled tokens from the `replies` of its
    session. Raises `VersionsUnknown` when a reply the branch holds is not among them."""
    ids = np.asarray(branch.token_ids, np.int32)
    mask = np.asarray(branch.sampled_mask, bool)
    first = int(np.argmax(mask))
    versions = np.full(len(ids), -1, np.int64)
    offset = 0
    for node in branch.nodes:
        node_mask = np.asarray(node.mask, bool)
        if node_mask.any():
            positions = offset + np.flatnonzero(node_mask)
            sampled = tuple(int(t) for t in np.asarray(node.token_ids)[node_mask])
            versions[positions] = _reply_versions(sampled, replies, session)
        offset += len(node.token_ids)
    tail = versions[first:]
    for i in range(1, len(tail)):  # tokens between replies: the version of the reply before them
        if tail[i] < 0:
            tail[i] = tail[i - 1]
    spans = _spans(tail)
    calls = [c for c in branch.calls if c.error is None]
    finish = calls[-1].finish_reason if calls else None
    return dict(
        version=spans[0][0] if spans else 0,
        version_end=spans[-1][0] if spans else 0,
        finish_reason="length" if finish == "length" else "stop",
        worker="",
        prompt_tokens=ids[:first],
        tokens=ids[first:],
        logprobs=np.asarray(branch.logprobs, np.float32)[first:],
        spans=spans,
        mask=_ranges(mask[first:]),
    )


def _reply_versions(sampled: tuple[int, ...], replies: Sequence[Reply], session: str) -> np.ndarray:
    """The version of each token of `sampled` (one call's answer, as the trace holds it), from the reply that wrote
    it."""
    for reply in reversed(replies):  # a retried call's answer is the last one with these tokens
        if reply.tokens[: len(sampled)] == sampled:
            out = np.zeros(len(sampled), np.int64)
            for version, start, end in reply.spans:
                out[start : min(end, len(sampled))] = version
            return out
    raise VersionsUnknown(
        f"session {session}: {len(sampled)} tokens the model wrote match no answer the gateway gave it "
        f"({len(replies)} answers kept): were its calls made through this VerifiersRollouts?"
    )


def _spans(versions: np.ndarray) -> list[Span]:
    """`(version, start, end)` runs of a per-token version array."""
    if not len(versions):
        return []
    starts = np.flatnonzero(np.diff(versions, prepend=versions[:1] - 1))
    ends = [*starts[1:].tolist(), len(versions)]
    return [(int(versions[s]), int(s), int(e)) for s, e in zip(starts.tolist(), ends, strict=True)]


def _ranges(mask: np.ndarray) -> list[tuple[int, int]]:
    """The `[start, end)` runs of True in `mask`."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]
