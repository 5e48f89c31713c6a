"""The lookup_agent taskset, its reward, and the env loop: a tool call, then a model turn, per lookup."""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterable

import verifiers.v1 as vf
from pydantic import Field, model_validator

from lookup_agent.corpus import lookups_per_task, make_corpus
from lookup_agent.tool import LookupTools

SYSTEM_PROMPT = "Repeat the user's text exactly. Answer with the text only."
"""The agent's instruction: each user turn holds the code a lookup tool returned."""
TURN = 'Repeat this text: "{result}"'
"""A turn: the tool's result (the record's code); the model's answer is scored against the code."""


def similarity(answer: str, target: str) -> float:
    """difflib's ratio of the stripped answer against the code, in [0, 1]; 1.0 iff equal."""
    return difflib.SequenceMatcher(None, answer.strip(), target, autojunk=False).ratio()


class LookupData(vf.TaskData):
    records: list[str]
    """The record ids the episode looks up, in order (one tool call and one model turn each)."""
    codes: list[str]
    """Their codes: the answer of each turn."""


class LookupTask(vf.Task[LookupData]):
    @vf.reward
    async def codes(self, task: LookupData, trace: vf.Trace) -> float:
        """Mean similarity of the i-th reply to the i-th code (a missing reply scores 0)."""
        replies = _replies(trace)
        scores = [
            similarity(replies[i], code) if i < len(replies) else 0.0 for i, code in enumerate(task.codes)
        ]
        return sum(scores) / len(scores)

    @vf.metric
    async def exact(self, task: LookupData, trace: vf.Trace) -> float:
        replies = _replies(trace)
        return sum(r.strip() == c for r, c in zip(replies, task.codes, strict=False)) / len(task.codes)

    @vf.metric
    async def lookups(self, task: LookupData, trace: vf.Trace) -> float:
        return float(len(task.records))


def _replies(trace: vf.Trace) -> list[str]:
    messages = trace.branches[-1].messages if trace.branches else []
    return [m.content if isinstance(m.content, str) else "" for m in messages if m.role == "assistant"]


class LookupTasksetConfig(vf.TasksetConfig):
    num_examples: int = Field(1000, ge=1)
    """How many tasks `load()` yields."""
    seed: int = 0
    """Seed of the corpus, the lookups of each task and their latencies."""
    corpus_size: int = Field(500, ge=1)
    """Records in the corpus."""
    min_calls: int = Field(1, ge=1)
    """Fewest lookups of a task."""
    max_calls: int = Field(8, ge=1)
    """Most lookups of a task (the Pareto tail is cut here)."""
    calls_alpha: float = Field(1.2, gt=0)
    """Pareto shape of the lookup count: smaller = heavier tail."""

    @model_validator(mode="after")
    def _check(self) -> LookupTasksetConfig:
        if self.min_calls > self.max_calls:
            raise ValueError(f"min_calls ({self.min_calls}) > max_calls ({self.max_calls})")
        return self


class LookupTaskset(vf.Taskset[LookupTask, LookupTasksetConfig]):
    def load(self) -> Iterable[LookupTask]:
        cfg = self.config
        corpus = make_corpus(cfg.corpus_size, cfg.seed)
        ids = sorted(corpus)
        rng = random.Random(f"tasks:{cfg.seed}")
        tasks = []
        for i in range(cfg.num_examples):
            n = lookups_per_task(rng, min_calls=cfg.min_calls, max_calls=cfg.max_calls, alpha=cfg.calls_alpha)
            records = rng.sample(ids, n)
            data = LookupData(id=f"lookup-{i}", prompt=None, system_prompt=SYSTEM_PROMPT, records=records,
                              codes=[corpus[r] for r in records])  # fmt: skip
            tasks.append(LookupTask(data, cfg.task))
        return tasks


class LookupEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    """The trained seat."""
    latency_median_s: float = Field(0.3, gt=0)
    """Median latency of one lookup call (seconds)."""
    latency_sigma: float = Field(1.0, ge=0)
    """Lognormal shape of the latency: 1.0 gives p90 = 3.6x and p99 = 10x the median."""
    latency_max_s: float = Field(10.0, gt=0)
    """Latencies are cut here."""


class LookupEnv(vf.Env[LookupEnvConfig]):
    """Per lookup: the env calls the MCP lookup tool (its latency), then the model answers its result."""

    def __init__(self, config: LookupEnvConfig) -> None:
        super().__init__(config)
        taskset_cfg = self.taskset.config
        self.tools = LookupTools(
            make_corpus(taskset_cfg.corpus_size, taskset_cfg.seed), seed=taskset_cfg.seed,
            median_s=config.latency_median_s, sigma=config.latency_sigma, max_s=config.latency_max_s,
        )  # fmt: skip

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        data = task.data
        async with agents.agent.interaction(task) as agent, self.tools.client() as tools:
            for call, record in enumerate(data.records):
                result = await tools.call_tool("lookup", {"record": record, "task": data.id, "call": call})
                text = "".join(getattr(part, "text", "") for part in result.content)
                segment = await agent.turn(TURN.format(result=text))
                if segment.terminated:
                    break
