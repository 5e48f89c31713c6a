"""Every environment of a run checked before anything starts: its id names an installed environment
("did you mean" over the installed ones when not), its module imports, and its args and config validate
against the environment's own config classes (an error names the class the key belongs to).

    rl @ rl.toml [--dry-run] ─parse─► verifiers_config.validate_envs(env_keys(orchestrator))
        find_env(id): the module verifiers would import (`reverse-text` -> `reverse_text`) exists?
            no ─► ValueError "... did you mean 'reverse-text'? (installed: ...)"
        resolve_verifiers_config(env): imports the env, validates args/config (verifiers' own path);
            a failure is described here (`describe_error`: the config class a key belongs to)

Used by `verifiers_config.py` (`validate_envs`, called by `entrypoints/rl.py` through the loader's `check`
hook, so `--dry-run` runs it too) before the launcher starts any process; imports nothing of rollouts/.
`import verifiers.v1` takes seconds, so it happens only when an env is to be validated, never at module
import.

Invariants: an installed environment is a distribution that requires `verifiers` (prime-async itself
excepted) or a taskset that ships with verifiers (`verifiers.v1.tasksets`); ids compare as verifiers
imports them (owner/ and @version dropped, `-` = `_`, case-insensitive); every failure is one
`ValueError` line naming the config key (`orchestrator.env.id`, `orchestrator.envs[1].args.seed`, ...).
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_async.config.env import EnvBaseConfig

if TYPE_CHECKING:
    from prime_async.config.orchestrator import OrchestratorConfig

_REQUIRES_VERIFIERS = re.compile(r"^verifiers\b", re.IGNORECASE)
_SELF = "prime-async"


def module_name(env_id: str) -> str:
    """The module verifiers imports for `env_id` (its `_import_plugin`: hub owner and version dropped)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def _builtin_tasksets() -> list[str]:
    """Tasksets that ship with verifiers (subpackages of `verifiers.v1.tasksets`), found without importing."""
    spec = importlib.util.find_spec("verifiers")
    roots = spec.submodule_search_locations if spec else None
    if not roots:
        return []
    folder = Path(next(iter(roots))) / "v1" / "tasksets"
    return sorted(p.name for p in folder.iterdir() if (p / "__init__.py").exists()) if folder.is_dir() else []


def installed_env_ids() -> list[str]:
    """Ids of the installed environments (module docstring), as their packages spell them."""
    ids = set(_builtin_tasksets())
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and name != _SELF and any(_REQUIRES_VERIFIERS.match(r) for r in dist.requires or []):
            ids.add(name)
    return sorted(ids)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def find_env(env_id: str, key: str) -> None:
    """ValueError naming `key` and the closest installed ids when no module answers to `env_id`."""
    module = module_name(env_id)
    if _module_exists(module) or module in _builtin_tasksets():
        return
    installed = installed_env_ids()
    by_module = {module_name(i): i for i in installed}
    close = [by_module[m] for m in difflib.get_close_matches(module, list(by_module), n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"{key} {env_id!r}: no installed environment has this id (no module {module!r}); {hint}(installed: "
        f"{', '.join(installed) or 'none'}; an environment is a package that depends on verifiers, "
        "installed in this environment, e.g. `uv pip install -e path/to/env`)"
    )


def describe_error(env_cfg: EnvBaseConfig, error: dict[str, Any]) -> str:
    """The reason and owner of one pydantic error of a verifiers env config: `unknown key (did you mean
    'num_examples'?) in <module.Class>` or `<pydantic's message> (a field of <module.Class>)`."""
    owner = config_owner(env_cfg, tuple(error["loc"]))
    name = f"{owner.__module__}.{owner.__qualname__}"
    if error["type"] != "extra_forbidden":
        return f"{error['msg']} (a field of {name})"
    close = difflib.get_close_matches(str(error["loc"][-1]), list(owner.model_fields), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key{hint}: {name} declares {', '.join(owner.model_fields) or 'no field'}"


def config_owner(env_cfg: EnvBaseConfig, loc: tuple[Any, ...]) -> Any:
    """The config class that holds the key at `loc` of a verifiers env-config validation error
    (`taskset.num_exampels` -> the taskset's config class, `agent.max_turnz` -> the seat's class), found
    by walking the env's config classes along `loc`; the env config's own class when the walk stops."""
    from pydantic import BaseModel
    from verifiers.v1.utils.loaders import env_config_type, taskset_config_type

    model: type[BaseModel] = env_config_type(env_cfg.id, str(env_cfg.config.get("id") or ""))
    for depth, segment in enumerate(loc[:-1]):
        if depth == 0 and segment == "taskset":
            model = taskset_config_type(env_cfg.id)
            continue
        field = model.model_fields.get(str(segment))
        if field is None:
            break
        default = field.default
        if isinstance(default, BaseModel):
            model = type(default)
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            model = field.annotation
        else:
            break
    return model


def env_keys(cfg: OrchestratorConfig) -> list[tuple[str, EnvBaseConfig]]:
    """(config key, env) of every environment of an orchestrator config: training, then eval."""
    train = list(cfg.envs)
    out = [
        ("orchestrator.env" if len(train) == 1 else f"orchestrator.envs[{i}]", e) for i, e in enumerate(train)
    ]
    evals = list(cfg.eval.envs) if cfg.eval is not None else []
    out += [(f"orchestrator.eval.envs[{i}]", e) for i, e in enumerate(evals)]
    return out
