"""The verifiers env config of an `[[orchestrator.env]]` table: the seats the environment declares, filled
with the runner's harness and the subprocess runtime, the user's `env.config` merged over them, resolved by
verifiers with one-line errors (`env_check.py`).

Who calls it: `verifiers_source.py` (loading the env), `entrypoints/rl.py` (`validate_envs`: every env of
a run checked before anything starts, `--dry-run` too), `sft/data.py`.
Importing it is cheap; verifiers is imported by the functions.

Invariants:
- example `i` of the env is the i-th task of the resolved taskset, so the config fully names the data;
- the runner's harness goes only to seats that pin none or verifiers' `null` chat program
  (`runners.RUNNERS[env.runner].harness()`), the subprocess runtime only to seats left on verifiers'
  default runtime; `env.config` is deep-merged last, and `env.config.taskset` is refused (it is `env.args`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from prime_async.config.dicts import deep_merge
from prime_async.config.env import EnvBaseConfig
from prime_async.rollouts import env_check
from prime_async.rollouts.runners import RUNNERS

if TYPE_CHECKING:
    from prime_async.config.orchestrator import OrchestratorConfig


def verifiers_env_config(env_cfg: EnvBaseConfig) -> dict[str, Any]:
    """The raw verifiers env config for `env_cfg` (validated later by `vf.resolve_env_config`): the
    seats the environment's own `vf.EnvConfig` declares, filled with the runner's defaults (a seat
    pinning a harness other than verifiers' `null` chat program, or a runtime, keeps its own)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.runtimes import PrimeConfig
    from verifiers.v1.utils.loaders import env_config_type

    user = copy.deepcopy(env_cfg.config)
    if "taskset" in user:
        raise ValueError("orchestrator.env.config.taskset: set the taskset's fields in orchestrator.env.args")
    raw: dict[str, Any] = {"taskset": {**env_cfg.args, "id": env_cfg.id}}
    if env_cfg.episode_timeout_s is not None:
        raw["timeout"] = {"episode": env_cfg.episode_timeout_s}
    cls = env_config_type(env_cfg.id, str(user.get("id") or ""))
    for name, field in cls.model_fields.items():
        declared = field.default
        if not isinstance(declared, AgentConfig):
            continue
        seat: dict[str, Any] = {}
        if declared.runtime == PrimeConfig():
            seat["runtime"] = {"type": "subprocess"}
        if declared.harness is None or declared.harness.id == "null":
            seat["harness"] = RUNNERS[env_cfg.runner].harness()
        raw[name] = seat
    return deep_merge(raw, user)


def resolve_verifiers_config(env_cfg: EnvBaseConfig, *, key: str = "orchestrator.env") -> Any:
    """`vf.resolve_env_config(verifiers_env_config(env_cfg))`; an unknown id (with the closest installed
    ids), an env that fails to import, a key the environment does not declare or a bad value raises one
    ValueError line naming the key under `key` and the config class it belongs to (`env_check.py`)."""
    import verifiers.v1 as vf
    from pydantic import ValidationError

    try:
        return vf.resolve_env_config(verifiers_env_config(env_cfg))
    except ModuleNotFoundError as e:
        env_check.find_env(env_cfg.id, f"{key}.id")  # not installed: "did you mean"
        cause = e.__cause__ if isinstance(e.__cause__, ModuleNotFoundError) else e
        raise ValueError(
            f"{key}.id {env_cfg.id!r}: the environment is installed but importing it failed: {cause}"
        ) from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        where = "args" if loc and loc[0] == "taskset" else "config"
        path = ".".join(loc[1:] if where == "args" else loc)
        more = f"; {e.error_count() - 1} more error(s)" if e.error_count() > 1 else ""
        reason = env_check.describe_error(env_cfg, err)
        raise ValueError(f"{key}.{where}.{path}: {reason} (environment {env_cfg.id!r}{more})") from None


def validate_envs(orchestrator_cfg: OrchestratorConfig) -> None:
    """Every environment of the run (training, then eval) installed, importable, and its args and
    config valid; the first failure raises one ValueError line naming its key (`env_check.py`)."""
    for key, env_cfg in env_check.env_keys(orchestrator_cfg):
        env_check.find_env(env_cfg.id, f"{key}.id")
        resolve_verifiers_config(env_cfg, key=key)
