"""Running episodes: what turns an environment and the inference engines into trained trajectories.
Below both `orchestrator/` (training) and `eval/`; imports nothing above it (docs/ARCHITECTURE.md).

    types.py             Episode, PolicySpan, RolloutSource (the protocol every source implements), NoGateway
    env_sources.py       the verifiers rollout sources of a list of env configs, and their metrics
    verifiers_source.py  VerifiersRolloutSource: loads the env, opens a gateway session per episode,
                         runs it on the env's runner, converts the result (`build_rollout_source`)
    verifiers_config.py  an env table -> the verifiers env config (seats, runner harness), resolved
    runners.py           EnvRunner (protocol) and RUNNERS: in-process, subprocess, env server
    episode.py           verifiers episode/trace -> trained trajectories (tokens, masks, logprobs, versions)
    inprocess_harness.py the default runner: verifiers' own chat/tool program inside the orchestrator
    inprocess_tools.py   Python toolsets served in process (MCP in-memory transport), per rollout
    env_server.py        the other runner: verifiers' env server in a spawned process
    renderer_choice.py   which chat renderer a model gets; refusal of tool envs without one
    gateway.py           the HTTP gateway in front of the engines (sticky engine per episode, seq_len clamp)
    episode_errors.py    failed episodes logged once, summarised in fatal errors
    engine_checks.py     engines healthy and belonging to this run
    tasks.py             a taskset's tasks by example id (LazyTasks for streams)
    seeds.py             the sampling seeds of deterministic runs

This package's `__init__` imports nothing: `types` stays cheap to import (verifiers is loaded by
`verifiers_source.py` only, which takes ~6 s).
"""
