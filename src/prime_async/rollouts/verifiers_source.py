"""Rollout source backed by verifiers v1: loads an environment by id and runs single episodes of it
against inference through the token gateway.

    dispatcher ──run_episode(example_id, engine_key, sampling)──► VerifiersRolloutSource
        verifiers Env.run_episode(task, ModelContext(model=<gateway session key>, client=TrainClientConfig))
          (runner `env_server`: the same call inside verifiers' env server process, over ZeroMQ)
          harness (in-process chat loop | `null` program in a subprocess) ──► interception server
            ──► TrainClient (renders the chat template to token ids) ──POST /inference/v1/generate──► Gateway
                ──► EngineClient.generate on the session's sticky engine (SGLang /generate)
        ◄── Episode (token_ids, loss_mask, sampler_logprobs, token_versions, reward, status), or one
            per trained seat of a multi-agent env (`envs/episode.build_episodes`)

Who calls it: `env_sources.py` builds one per env with `build_rollout_source(...)`; the orchestrator hands
it to the dispatcher as its `RolloutSource`. How an episode runs is the env's runner (`runners.py`).
`import verifiers.v1` is slow (10-20 s), so it happens in `start()`, never at module import (`--help`
stays fast).

Invariants:
- the environment is loaded through verifiers' own path (`resolve_env_config` -> `load_environment`) from
  the config `verifiers_config.py` builds, and example `i` is the i-th task of `env.taskset` (its
  `load()` order), fixed for the run; an infinite taskset (`INFINITE`, unbounded) is drawn lazily
  (`tasks.LazyTasks`, `num_examples` None); a key the env config does not declare fails `start()`;
- `run_episode` never raises for environment faults (see `envs/episode.py`); it raises
  `asyncio.CancelledError` when cancelled, after aborting the episode's in-flight engine requests;
- every gateway session opened for an episode is closed when the episode ends, whatever the outcome;
- the runner is started by `start()` and stopped by `stop()`; the gateway outlives it on both ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from prime_async.config.env import EnvBaseConfig
from prime_async.engine_api import EngineClient, SamplingParams
from prime_async.rollouts import prompt_limit, token_bridge
from prime_async.rollouts.gateway import Gateway, GatewayCall
from prime_async.rollouts.images import image_placer
from prime_async.rollouts.renderer_choice import check_tools_renderer, choose_renderer
from prime_async.rollouts.runners import make_runner
from prime_async.rollouts.tasks import LazyTasks
from prime_async.rollouts.types import EngineTraffic, Episode
from prime_async.rollouts.verifiers_config import resolve_verifiers_config
from prime_async.utils import pydantic_speedups
from prime_async.weights.request_gate import RequestGate

logger = logging.getLogger(__name__)


def _quiet_library_loggers() -> None:
    """verifiers logs two INFO lines per rollout, and uvicorn/renderers/mcp (in-process tool servers),
    httpx and aiohttp's access log (one line per model/tool/state request) chat too: keep them at WARNING
    unless the user asked for DEBUG or set their levels explicitly (handlers stay the entrypoint's)."""
    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        return
    for name in ("verifiers", "renderers", "uvicorn", "uvicorn.error", "mcp", "httpx", "aiohttp.access"):
        if logging.getLogger(name).level == logging.NOTSET:
            logging.getLogger(name).setLevel(logging.WARNING)


CANCELLED_KEPT = 4096  # cancelled episodes' lengths kept for the dispatcher to take (oldest forgotten)


@dataclass
class SampledShare:
    """How one verifiers episode's sampled tokens (every model call of its gateway session) divide into
    its trained trajectories, learned from the finished episodes. A cancelled episode's calls are not
    attributed to seats (the gateway does not know them), so `split` counts it as the mean number of
    trained trajectories per episode, sharing the fraction of its tokens the finished episodes' trained
    trajectories sampled. A single-seat env: one trajectory with its own tokens (share 1 when the trace
    sampled every token of the session)."""

    episodes: int = 0
    trajectories: int = 0
    session_tokens: int = 0
    trajectory_tokens: int = 0

    def observe(self, session_tokens: int, trajectory_tokens: list[int]) -> None:
        """One finished episode: its session's sampled tokens and each trained trajectory's."""
        if session_tokens <= 0 or not trajectory_tokens:
            return
        self.episodes += 1
        self.trajectories += len(trajectory_tokens)
        self.session_tokens += session_tokens
        self.trajectory_tokens += sum(trajectory_tokens)

    def split(self, session_tokens: int) -> list[int]:
        """The per-trajectory lengths a cancelled episode whose session sampled `session_tokens` counts as."""
        if not self.episodes:
            return [session_tokens]
        k = max(1, round(self.trajectories / self.episodes))
        share = self.trajectory_tokens / self.session_tokens
        return [round(session_tokens * share / k)] * k


class VerifiersRolloutSource:
    """`RolloutSource` over a verifiers environment. Use `async with` or `start()`/`stop()`."""

    def __init__(
        self,
        *,
        env_cfg: EnvBaseConfig,
        engines: list[EngineClient],
        model_path: str,
        seq_len: int,
        gate: RequestGate | None = None,
    ) -> None:
        self.env_cfg = env_cfg
        self.model_path = model_path
        self.seq_len = seq_len
        self.gateway = Gateway(
            engines=engines, seq_len=seq_len, host=env_cfg.gateway_host, port=env_cfg.gateway_port, gate=gate,
            images=image_placer(model_path),
        )  # fmt: skip
        self.runner = make_runner(env_cfg)
        self._env: Any = None
        self._tasks: list[Any] | LazyTasks = []
        self._client_cfg: Any = None
        self._started = False
        self.counts: dict[str, int] = {"ok": 0, "error": 0, "aborted": 0, "cancelled": 0}
        self.error_kinds: dict[str, int] = {}
        self.branch_splits: dict[str, int] = {}
        """Branches split off by cause (`episode.branch_split_causes`); a token-exact episode has none."""
        self.untrained_sampled_tokens = 0
        """Sampled tokens of ok trajectories outside their trained branch (seq_len cuts included)."""
        self.overflow_episodes = 0
        self.images = 0
        """Images in the trained tokens of ok trajectories (a vision-language model's)."""
        """Episodes with a turn that did not fit seq_len (`Episode.overlong`, status ok)."""
        self.episode_seconds = 0.0
        self.cancelled_lengths: dict[str, list[int]] = {}
        """Per cancelled episode (engine key): one length per trajectory, what it had sampled when
        cancelled (`SampledShare.split`); the dispatcher takes them (`take_cancelled_lengths`)."""
        self.sampled_share = SampledShare()
        self.call_log: dict[str, list[GatewayCall]] | None = None
        """When a dict (`doctor` sets one): every episode's recorded model calls, by engine key."""

    @property
    def num_examples(self) -> int | None:
        """Number of tasks; None for an infinite taskset (streamed, drawn lazily)."""
        assert self._env is not None, "start() the rollout source first"
        return None if isinstance(self._tasks, LazyTasks) else len(self._tasks)

    async def start(self) -> None:
        t0 = time.perf_counter()
        _quiet_library_loggers()
        pydantic_speedups.install()
        import verifiers.v1 as vf

        config = resolve_verifiers_config(self.env_cfg)
        self._env = vf.load_environment(config)
        self._load_tasks()
        requested = dict(self.env_cfg.renderer)
        token_exact = bool(requested.pop("token_exact", True))
        renderer = choose_renderer(requested, self.model_path)
        check_tools_renderer(self._env, self.env_cfg.id, renderer, self.model_path)
        await self.gateway.start()
        self._client_cfg = vf.TrainClientConfig(
            base_url=f"{self.gateway.base_url}/v1",
            api_key_var="PRIME_ASYNC_GATEWAY_KEY",
            # token in, token out: every turn extends the previous turn's tokens (token_bridge.py)
            renderer=token_bridge.custom_config(renderer) if token_exact else renderer,
            renderer_model_name=self.model_path,
        )
        try:
            await self.runner.start(self._env, config)
        except BaseException:
            await self.gateway.stop()
            raise
        self._started = True
        logger.info(
            "env %s: %s examples, runner=%s, renderer=%s, gateway %s (%.1fs)",
            self.env_cfg.id, self.num_examples or "infinite (streamed)", self.env_cfg.runner,
            renderer["name"], self.gateway.base_url, time.perf_counter() - t0,
        )  # fmt: skip

    def _load_tasks(self) -> None:
        taskset = self._env.taskset
        if taskset.bounded:
            self._tasks = list(taskset)
        else:
            self._tasks = LazyTasks(lambda: iter(taskset))
        try:
            self._tasks[0]
        except IndexError:
            raise ValueError(f"env.id {self.env_cfg.id!r} loaded no tasks; check env.args") from None

    async def stop(self) -> None:
        await self.runner.stop()
        await self.gateway.stop()

    async def __aenter__(self) -> VerifiersRolloutSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _check_serving(self) -> None:
        if not self._started:
            raise RuntimeError("rollout source is not started")
        self.runner.check()

    def task(self, example_id: int) -> Any:
        """The verifiers task of example `example_id` (IndexError past a bounded taskset)."""
        return self._tasks[example_id]

    # -- declared capabilities of the RolloutSource protocol (rollouts/types.py) ----------------------
    def recorded_calls(self, engine_key: str) -> list[GatewayCall]:
        """The engine calls recorded so far by the running episode `engine_key` (none: not running)."""
        for session in self.gateway.sessions.values():
            if session.engine_key == engine_key:
                return list(session.calls)
        return []

    def take_cancelled_lengths(self, engine_key: str) -> list[int]:
        """What the cancelled episode `engine_key` had sampled, one length per trajectory; forgotten once
        taken (none: not cancelled, or already taken)."""
        return self.cancelled_lengths.pop(engine_key, [])

    async def freeze(self, timeout_s: float) -> None:
        """A planned stop: the gateway forwards no call any more (`Gateway.freeze`)."""
        await self.gateway.freeze(timeout_s)

    def release(self) -> None:
        """After the planned-stop checkpoint: the frozen gateway refuses the calls it held."""
        self.gateway.release()

    def engine_traffic(self) -> EngineTraffic:
        """The gateway's requests in flight and last answer time, per engine URL."""
        gateway = self.gateway
        return EngineTraffic(pending=gateway.pending_by_engine(), last_answer=dict(gateway.last_answer))

    async def run_episode(
        self, *, example_id: int, engine_key: str, sampling: SamplingParams,
        replay: list[GatewayCall] | None = None,
    ) -> Episode | list[Episode]:  # fmt: skip
        """One episode of example `example_id`: its `Episode`, or for a multi-agent env one per
        trained seat trace (a list, as the `RolloutSource` protocol allows). `replay`: the calls an
        earlier lifetime recorded for it (`rollouts/replay.py`)."""
        import verifiers.v1 as vf

        self._check_serving()
        task = self._tasks[example_id]  # IndexError: a bug of the caller (ids come from the DataSource)
        session = self.gateway.open_session(engine_key=engine_key, sampling=sampling, replay=replay)
        if self.runner.client_in_process:  # the train client runs here: spare it the GET /v1/models
            prompt_limit.record(self._client_cfg.base_url, session.key, self.seq_len)
        ctx = vf.ModelContext(
            client=self._client_cfg, model=session.key, sampling=vf.SamplingConfig(**sampling.to_vllm())
        )
        t0 = time.perf_counter()
        try:
            episodes = await self._run(task, ctx, example_id, session)
        except asyncio.CancelledError:
            await self._on_cancelled(engine_key, session.key)
            raise
        except Exception as e:  # tolerated: an env fault that escaped verifiers' own episode boundary
            episodes = [_rollout_error(example_id, e)]
        finally:
            if self.call_log is not None:
                self.call_log[engine_key] = list(session.calls)
            self.gateway.close_session(session.key)
            seconds = time.perf_counter() - t0
            self.episode_seconds += seconds
        for episode in episodes:
            episode.metrics["episode_seconds"] = seconds
            self._count(episode)
        return episodes[0] if len(episodes) == 1 else episodes

    async def _run(self, task: Any, ctx: Any, example_id: int, session: Any) -> list[Episode]:
        """Run the episode on the runner and convert it; learn the sampled share of a finished one."""
        from prime_async.rollouts.episode import build_episodes

        vf_episode = await self.runner.run(task, ctx)
        episodes = build_episodes(
            example_id=example_id, vf_episode=vf_episode, session=session, seq_len=self.seq_len
        )
        if all(ep.status in ("ok", "idle") for ep in episodes):
            self.sampled_share.observe(
                sum(len(call.output_ids) for call in session.calls),
                [ep.metrics.get("sampled_tokens", 0) for ep in episodes if ep.status == "ok"],
            )
        return episodes

    async def _on_cancelled(self, engine_key: str, session_key: str) -> None:
        """Abort the cancelled episode's engine requests and keep what it had sampled."""
        self.counts["cancelled"] += 1
        sampled = await asyncio.shield(self.gateway.cancel_session(session_key))
        self.cancelled_lengths[engine_key] = self.sampled_share.split(sampled)
        while len(self.cancelled_lengths) > CANCELLED_KEPT:  # never taken: e.g. cancelled at shutdown
            del self.cancelled_lengths[next(iter(self.cancelled_lengths))]

    def _count(self, episode: Episode) -> None:
        self.counts[episode.status] = self.counts.get(episode.status, 0) + 1
        if kind := episode.metrics.get("env_error"):
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        self._count_splits(episode)
        self._count_overflow(episode)
        if episode.status == "ok":
            self.images += len(episode.images)

    def _count_overflow(self, episode: Episode) -> None:
        """Count an episode with a turn that did not fit `seq_len` (`episode.overflow_turn`; a first
        prompt refused is the error `prompt_too_long` instead); warn once per source, naming the env, the
        turn and the lengths."""
        if not episode.overlong or episode.status != "ok":
            return
        self.overflow_episodes += 1
        if self.overflow_episodes > 1:
            return
        turn, prompt = episode.metrics.get("overflow_turn"), episode.metrics.get("overflow_prompt_tokens")
        where = (
            f"turn {turn}'s prompt is {prompt} tokens" if turn else f"it is {len(episode.token_ids)} tokens"
        )
        logger.warning(
            "env %s: an episode outgrew seq_len = %d (example %d: %s); it ends there and the sink's "
            "`overlong` policy trains it up to there or drops it. Raise seq_len, lower max_tokens or end "
            "episodes sooner (counted in env/%s/overflow_episodes; warned once)",
            self.env_cfg.label, self.seq_len, episode.example_id, where, self.env_cfg.label,
        )  # fmt: skip

    def _count_splits(self, episode: Episode) -> None:
        """Branch splits by cause and the sampled tokens left untrained by them (`episode.py`)."""
        for key, value in episode.metrics.items():
            if key.startswith("branch_splits/"):
                cause = key.removeprefix("branch_splits/")
                self.branch_splits[cause] = self.branch_splits.get(cause, 0) + int(value)
        if episode.status == "ok":
            untrained = int(episode.metrics.get("sampled_tokens", 0)) - sum(episode.loss_mask)
            self.untrained_sampled_tokens += max(untrained, 0)

    def metrics(self) -> dict[str, float]:
        """Episode outcome counts since start (`env/episodes/<status>`, `env/errors/<kind>`,
        `env/branch_splits/<cause>`, `env/untrained_sampled_tokens`, `env/overflow_episodes`, and with
        images `env/images`: images in ok trajectories)."""
        out: dict[str, float] = {f"env/episodes/{k}": float(v) for k, v in self.counts.items()}
        out.update({f"env/errors/{k}": float(v) for k, v in self.error_kinds.items()})
        out.update({f"env/branch_splits/{k}": float(v) for k, v in self.branch_splits.items()})
        out["env/untrained_sampled_tokens"] = float(self.untrained_sampled_tokens)
        out["env/overflow_episodes"] = float(self.overflow_episodes)
        if self.images:
            out["env/images"] = float(self.images)
        out["env/gateway_requests"] = float(self.gateway.num_requests)
        out.update(self.gateway.replay_stats.metrics())
        return out


def _rollout_error(example_id: int, e: Exception) -> Episode:
    """The error episode of an env fault that escaped verifiers' own episode boundary (logged)."""
    logger.warning("episode of example %d failed outside verifiers' boundary", example_id, exc_info=True)
    episode = Episode(example_id=example_id, status="error", error=f"rollout: {type(e).__name__}: {e}")
    episode.metrics["env_error"] = "rollout"
    return episode


def build_rollout_source(
    *,
    env_cfg: EnvBaseConfig,
    engines: list[EngineClient],
    model_path: str,
    seq_len: int,
    gate: RequestGate | None = None,
) -> VerifiersRolloutSource:
    """The verifiers-backed `RolloutSource` for `env_cfg`; `start()` it (or `async with`) before use.
    `gate`: the run's request gate in front of `engines` (None: a gate of its own)."""
    return VerifiersRolloutSource(
        env_cfg=env_cfg, engines=engines, model_path=model_path, seq_len=seq_len, gate=gate
    )
