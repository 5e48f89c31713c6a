"""The tests' fork server (`tests/zygote.py`) gives a command the process a plain start would: the same
exit status and output, its environment and working directory exactly, its own title in `ps`, default
signals; a command it does not serve starts plainly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import zygote

ROOT = Path(__file__).resolve().parents[1]
RL = [sys.executable, "-m", "prime_async.entrypoints.rl"]


def test_a_refused_command_matches_a_plain_start(tmp_path: Path):
    cmd = [*RL, "@", str(ROOT / "configs/tiny/rl.toml"), "--bogus-key", "1"]
    forked = zygote.run(cmd, cwd=ROOT, timeout=120)
    plain = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert isinstance(zygote.popen([sys.executable, "-c", "pass"]), subprocess.Popen)  # not served: plain
    assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == 2 and "bogus" in forked.stderr


def test_environment_directory_title_and_signals_are_the_commands_own(tmp_path: Path):
    env = {**os.environ, "ZYGOTE_TEST_MARK": "yes"}
    log = tmp_path / "rl.log"
    with log.open("w") as fh:
        proc = zygote.popen([*RL, "@", str(ROOT / "configs/tiny/rl.toml"), "--dry-run"], cwd=tmp_path,
                            env=env, stdout=fh, stderr=subprocess.STDOUT)  # fmt: skip
    title = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    cwd = os.readlink(f"/proc/{proc.pid}/cwd")
    assert proc.wait(120) == 0, log.read_text()[-2000:]
    assert "max_steps" in log.read_text()  # the dry run printed the resolved config
    assert f"{sys.executable} -m prime_async.entrypoints.rl @ " in title and cwd == str(tmp_path)
    assert b"ZYGOTE_TEST_MARK=yes" in environ  # what the tests' leftover checks look for
    killed = zygote.popen([*RL, "@", str(ROOT / "configs/tiny/rl.toml"), "--dry-run"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(60) == -signal.SIGKILL
    time.sleep(0.2)
    assert not Path(f"/proc/{killed.pid}").exists()  # reaped by the zygote: no zombie left
