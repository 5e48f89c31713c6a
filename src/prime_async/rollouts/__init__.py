"""verifiers environments as the orchestrator's rollout source, and the runners that play their episodes.

    source.py            VerifiersRolloutSource: loads the env, opens a gateway session per episode,
                         runs it with the configured runner, converts the result (`build_rollout_source`)
    episode.py           verifiers episode/trace -> trained trajectories (tokens, masks, logprobs, versions)
    inprocess_harness.py the default runner: verifiers' own chat/tool program inside the orchestrator
    inprocess_tools.py   Python toolsets served in process (MCP in-memory transport), per rollout
    env_server.py        the other runner: verifiers' env server in a spawned process
    renderer_choice.py   which chat renderer a model gets; refusal of tool envs without one

Only `source.py` is imported by the rest of the orchestrator (through this package).
"""

from prime_async.rollouts.source import VerifiersRolloutSource, build_rollout_source

__all__ = ["VerifiersRolloutSource", "build_rollout_source"]
