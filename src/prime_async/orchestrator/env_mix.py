"""The environment mix: which environment the next group comes from, and each environment's prompts.

    MixSchedule.next() ──name──► MixEnv(name, RolloutSource, DataSource, SamplingParams)
                                      └── data.next_example() ──► (example_id, epoch)

Who calls it: the dispatcher (`next_prompt` for every new group; `get` for a group's env), the group
table (`unused_group` for every group that ends untrained), the checkpoint code (`state_dict` /
`load_state_dict`) and the main loop (`metrics`). A run with one environment is a mix of one.

Schedule (Tijdeman's chairman assignment, deterministic, no randomness): with shares
`p_i = ratio_i / sum(ratios)`, `m` envs and `c_i` the groups of env i counted so far, the next group
(n = sum c_i + 1) goes to the env, among those with `n * p_i - c_i >= 1 / (2(m - 1))`, whose deadline
`(c_i + 1 - 1/(2(m-1))) / p_i` is earliest (ties: config order). Shares are exact fractions of the
ratios' decimal forms. A group that ends untrained (cancelled, stale, errored, filtered) gives its slot
back (`c_i -= 1`), so the counts are the groups trained or still live: the mix is a mix of training data.

Invariants:
- while no slot is given back, every prefix of n groups has `|c_i - n * p_i| <= 1 - 1/(2(m-1)) < 1`;
  a slot given back is refilled by the next dispatch (the env furthest behind): the trained-or-live mix
  stays within about one group of the ratio (`tests/orchestrator/test_env_mix.py`);
- the schedule's whole state is the counts `c_i`, saved with every env's data position
  (`state_dict(pending=...)`: each env's prompts issued but not trained are reissued first by that env,
  like retries, so they are taken out of its count and counted again when reissued); a resume continues
  from there: no prompt of any env skipped or issued twice;
- a group's prompt goes back to the data source of the env it came from (`Group.env`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from prime_async.engine_api import SamplingParams
from prime_async.orchestrator.data_source import DataSource
from prime_async.orchestrator.types import Group
from prime_async.rollouts.types import RolloutSource


class MixSchedule:
    """Deterministic interleaving of env names by ratio (module docstring); state = the counts."""

    def __init__(self, ratios: dict[str, float]):
        if not ratios:
            raise ValueError("the environment mix is empty")
        total = sum(Fraction(str(r)) for r in ratios.values())
        self.names = list(ratios)
        self.shares = {name: Fraction(str(r)) / total for name, r in ratios.items()}
        self.counts = dict.fromkeys(self.names, 0)
        m = len(self.names)
        self._eps = Fraction(1, 2 * (m - 1)) if m > 1 else Fraction(0)

    def give_back(self, name: str) -> None:
        """A group of `name` ended untrained: its slot is free again."""
        self.counts[name] -= 1

    def next(self) -> str:
        """The env of the next group (and count it)."""
        n = sum(self.counts.values()) + 1
        eligible = [x for x in self.names if n * self.shares[x] - self.counts[x] >= self._eps] or self.names
        name = min(eligible, key=lambda x: (self.counts[x] + 1 - self._eps) / self.shares[x])
        self.counts[name] += 1
        return name

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        counts = {str(k): int(v) for k, v in state["counts"].items()}
        if set(counts) != set(self.names):
            raise ValueError(
                f"checkpoint was taken with environments {sorted(counts)}, the config has "
                f"{sorted(self.names)}: resume with the same orchestrator.envs names or start without "
                "--resume"
            )
        self.counts = {name: counts[name] for name in self.names}


@dataclass
class MixEnv:
    """One training environment of the mix."""

    name: str
    source: RolloutSource
    data: DataSource
    sampling: SamplingParams
    ratio: float = 1.0


class EnvMix:
    """The training environments and the schedule that interleaves them."""

    def __init__(self, envs: Sequence[MixEnv]):
        self.envs = {env.name: env for env in envs}
        if len(self.envs) != len(envs):
            raise ValueError(f"environment names must be unique: {[e.name for e in envs]}")
        self.schedule = MixSchedule({env.name: env.ratio for env in envs})

    @classmethod
    def single(
        cls, *, source: RolloutSource, data: DataSource, sampling: SamplingParams, name: str = "default"
    ) -> EnvMix:
        """A mix of one environment (named like `Group.env`'s default)."""
        return cls([MixEnv(name=name, source=source, data=data, sampling=sampling)])

    def get(self, name: str) -> MixEnv:
        return self.envs[name]

    def next_prompt(self) -> tuple[MixEnv, int, int]:
        """`(env, example_id, epoch)` of the next group."""
        env = self.envs[self.schedule.next()]
        example_id, epoch = env.data.next_example()
        return env, example_id, epoch

    def unused_group(self, group: Group, *, retry: bool) -> None:
        """The group ended untrained: give its schedule slot back; `retry`: its prompt goes back into its
        own env's data source."""
        self.schedule.give_back(group.env)
        if retry:
            self.envs[group.env].data.retry(group.example_id, group.epoch)

    @property
    def num_retry_pending(self) -> int:
        return sum(env.data.num_retry_pending for env in self.envs.values())

    def state_dict(self, *, pending: Iterable[Group] = ()) -> dict[str, Any]:
        """Every env's data position (its `pending` prompts first) and the schedule's counts."""
        by_env: dict[str, list[tuple[int, int]]] = {name: [] for name in self.envs}
        for group in pending:
            by_env[group.env].append((group.example_id, group.epoch))
        data = {name: env.data.state_dict(pending=by_env[name]) for name, env in self.envs.items()}
        # a pending group is reissued like a retry: its slot is taken again when it is dispatched again
        counts = {name: c - len(by_env[name]) for name, c in self.schedule.counts.items()}
        return {"envs": data, "schedule": {"counts": counts}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore positions and schedule; a checkpoint of one env (`data` only) fits a mix of one."""
        if "envs" not in state:
            if len(self.envs) != 1:
                raise ValueError("checkpoint holds one environment's position; the config mixes several")
            (env,) = self.envs.values()
            env.data.load_state_dict(state["data"])
            return
        self.schedule.load_state_dict(state["schedule"])
        for name, env in self.envs.items():
            env.data.load_state_dict(state["envs"][name])

    def metrics(self) -> dict[str, float]:
        """Groups per env trained or live (`rollout/env/<name>/scheduled_groups`, the schedule's counts)."""
        return {f"rollout/env/{n}/scheduled_groups": float(c) for n, c in self.schedule.counts.items()}
