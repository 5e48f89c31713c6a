"""The doctor's table: one row per (env, check), then the fix of every failed check, then the configuration
lint's warnings (`config/lint.py`: they never fail the doctor)."""

from __future__ import annotations

from collections.abc import Sequence

from prime_async.doctor.checks import CheckResult


def render(rows: list[tuple[str, CheckResult]], warnings: Sequence[str] = ()) -> str:
    env_w = max([len("env"), *(len(env) for env, _ in rows)])
    check_w = max([len("check"), *(len(r.name) for _, r in rows)])
    lines = [f"{'env':<{env_w}}  {'check':<{check_w}}  result  detail"]
    for env, r in rows:
        lines.append(f"{env:<{env_w}}  {r.name:<{check_w}}  {r.status:<6}  {r.detail}")
    fails = [(env, r) for env, r in rows if r.passed is False]
    for env, r in fails:
        lines.append(f"fix [{env}] {r.name}: {r.fix}")
    lines += [f"warning {line}" for line in warnings]
    lines.append(f"config lint: {len(warnings)} warning(s)" if warnings else "config lint: no warning")
    verdict = f"{len(fails)} check(s) failed" if fails else "every check passed (or was skipped, see detail)"
    lines.append(f"doctor: {verdict}")
    return "\n".join(lines)
