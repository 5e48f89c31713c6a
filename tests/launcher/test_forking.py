"""`launcher/forking.py`: components started as forks of `rl` behave as exec'd ones, and a fork is refused
where it would not be safe. Each case runs in a fresh interpreter (a pytest-xdist worker has threads of its
own, so it may never fork); the whole-run behaviour (titles, signals, restarts, no process left) is covered
by the real `rl` runs of tests/launcher/test_lifecycle.py, tests/reliability/ and the feature matrix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_a_forked_command_runs_with_its_argv_env_log_and_exit_status(tmp_path: Path) -> None:
    script = f"""
        import os, sys
        from pathlib import Path
        from prime_async.launcher import forking
        from prime_async.launcher.process import ChildProcess

        forking.PRELOAD = ("prime_async.config.trainer",)
        forking.preload()
        trainer = str(Path(sys.executable).parent / "trainer")
        env = {{**os.environ, "PRIME_ASYNC_FORK_TEST": "1"}}
        ok = ChildProcess("trainer", [trainer, "@", "{ROOT}/configs/tiny/trainer.toml", "--dry-run"],
                          Path("ok.log"), env=env, fork=True)
        bad = ChildProcess("trainer", [trainer, "@", "missing.toml"], Path("bad.log"), env=env, fork=True)
        for child in (ok, bad):
            assert forking.can_fork(), "a fork must leave the parent able to fork again"
            child.start()
            assert isinstance(child.process, forking.ForkedChild), child.process
            child.process.wait(timeout=120)
        print("codes", ok.returncode(), bad.returncode())
    """
    out = _run(script, tmp_path)
    assert "codes 0 2" in out, out
    assert "max_steps = 5" in (tmp_path / "ok.log").read_text()  # --dry-run printed the config
    assert "missing.toml" in (tmp_path / "bad.log").read_text()  # the one-line error, in its log


def test_a_child_sees_exactly_its_environment_in_a_session_of_its_own(tmp_path: Path) -> None:
    script = """
        import os, signal
        from prime_async.launcher import forking

        forking.PRELOAD = ()
        forking.preload()
        env = {"ONLY_THIS": "1", "PATH": os.environ["PATH"]}
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            log = os.open("c.log", os.O_WRONLY | os.O_CREAT)
            forking._become_component(["orchestrator", "@", "x.toml"], env, log)
            os.write(write, repr((dict(os.environ), os.getsid(0) == os.getpid(),
                                  signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)).encode())
            os._exit(0)
        os.close(write)
        print(os.read(read, 65536).decode())
        os.waitpid(pid, 0)
    """
    out = _run(script, tmp_path)
    assert out.strip() == repr(({"ONLY_THIS": "1", "PATH": __import__("os").environ["PATH"]}, True, True))


def test_no_fork_after_a_torch_op_or_a_thread(tmp_path: Path) -> None:
    script = """
        import threading, time
        from prime_async.launcher import forking

        forking.PRELOAD = ("torch", "numpy")
        assert not forking.can_fork(), "before preload"
        forking.preload()
        assert forking.can_fork(), "right after preload"
        import torch
        torch.randn(512, 512) @ torch.randn(512, 512)  # starts torch's intra-op pool where cores allow
        after_op = forking.can_fork()
        event = threading.Event()
        thread = threading.Thread(target=event.wait)
        thread.start()
        with_thread = forking.can_fork()
        event.set()
        thread.join()
        print("after_op", after_op, torch.get_num_threads(), "with_thread", with_thread)
    """
    out = _run(script, tmp_path)
    assert "with_thread False" in out, out
    if " 1 with_thread" not in out:  # one intra-op thread starts no pool: nothing to see
        assert "after_op False" in out, out


def test_only_console_scripts_with_a_config_fork(tmp_path: Path) -> None:
    from prime_async.launcher.forking import forkable_command

    bin_dir = Path(sys.executable).parent
    script = forkable_command([str(bin_dir / "orchestrator"), "@", "c.toml"])
    assert script is not None and script.value == "prime_async.entrypoints.orchestrator:main"
    assert forkable_command([sys.executable, "-m", "torch.distributed.run", "@", "c.toml"]) is None
    assert forkable_command([str(bin_dir / "plan"), "@", "c.toml"]) is None
    too_long = [str(bin_dir / "orchestrator"), "@", "x" * 100_000]
    assert forkable_command(too_long) is None  # its title would not fit in the argv area
