"""The doctor's table: one row per (env, check), then the fix of every failed check."""

from __future__ import annotations

from prime_async.doctor.checks import CheckResult


def render(rows: list[tuple[str, CheckResult]]) -> str:
    env_w = max([len("env"), *(len(env) for env, _ in rows)])
    check_w = max([len("check"), *(len(r.name) for _, r in rows)])
    lines = [f"{'env':<{env_w}}  {'check':<{check_w}}  result  detail"]
    for env, r in rows:
        lines.append(f"{env:<{env_w}}  {r.name:<{check_w}}  {r.status:<6}  {r.detail}")
    fails = [(env, r) for env, r in rows if r.passed is False]
    for env, r in fails:
        lines.append(f"fix [{env}] {r.name}: {r.fix}")
    verdict = f"{len(fails)} check(s) failed" if fails else "every check passed (or was skipped, see detail)"
    lines.append(f"doctor: {verdict}")
    return "\n".join(lines)
