"""What the daemon's children inherit (``supervisor.children``, ``executor.forkserver``): a
child's signal never reaches the daemon's loop, and an engine core holds none of the daemon's
sockets or pipes, even when ``VLLM_WORKER_MULTIPROC_METHOD=fork`` is asked for (vLLM's own
default, and what it uses on CUDA; the CPU platform forces ``spawn``, so a real daemon on this
machine cannot show the fork case: these tests run the daemon's set-up in a process of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from supervisor.children import prefer_spawn

ROOT = Path(__file__).resolve().parents[2]


def run(script: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# An asyncio loop with a SIGTERM handler (the daemon's) forks a child from a worker thread (as a
# build in ``asyncio.to_thread`` would); the child is then sent SIGTERM alone.
FORKED_CHILD = """
    import asyncio, json, os, signal, sys, time
    from supervisor.children import forget_signals_in_forks
    if sys.argv[1] == "protected":
        forget_signals_in_forks()
    async def main():
        loop = asyncio.get_running_loop()
        fired = []
        loop.add_signal_handler(signal.SIGTERM, lambda: fired.append(1))
        def fork(own_handler):
            pid = os.fork()
            if pid == 0:
                if own_handler:  # as vLLM's engine core does
                    signal.signal(signal.SIGTERM, lambda *a: os._exit(7))
                time.sleep(3)
                os._exit(0)
            return pid
        out = {}
        for own in (True, False):
            pid = await asyncio.to_thread(fork, own)
            await asyncio.sleep(0.3)
            os.kill(pid, signal.SIGTERM)
            _, status = await asyncio.to_thread(os.waitpid, pid, 0)
            await asyncio.sleep(0.3)
            out["own" if own else "default"] = os.waitstatus_to_exitcode(status)
        out["daemon_handler_fired"] = bool(fired)
        print(json.dumps(out))
    asyncio.run(main())
"""


def test_a_forked_childs_sigterm_never_reaches_the_daemons_loop():
    # Without the set-up the mechanism is real: the child's signal fires the daemon's handler.
    bare = run(FORKED_CHILD.replace("sys.argv[1]", "'bare'"))
    assert bare["daemon_handler_fired"], bare
    protected = run(FORKED_CHILD.replace("sys.argv[1]", "'protected'"))
    assert not protected["daemon_handler_fired"], protected
    assert protected["own"] == 7  # a child's own handler runs
    assert protected["default"] == -15  # a child without one dies of SIGTERM, as a fresh process would


ENGINE_CORE_START = """
    import asyncio, json, os, signal, socket, time
    from chaos.leaks import open_files
    from executor.forkserver import engine_core_start_method
    import vllm.v1.engine.utils as engine_utils

    listener = socket.create_server(("127.0.0.1", 0))  # the HTTP port
    reaper_r, reaper_w = os.pipe()  # the crash reaper's pipe: the daemon holds the write end
    os.set_inheritable(reaper_w, False)

    def child_start(use_forkserver):
        with engine_core_start_method(use_forkserver):
            ctx = engine_utils.get_mp_context()  # what vLLM's engine-core launcher asks for
        proc = ctx.Process(target=time.sleep, args=(30,), daemon=True)
        proc.start()
        time.sleep(1.0)
        return ctx.get_start_method(), proc

    async def main():
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: None)  # the loop's wake-up socket
        method, proc = await asyncio.to_thread(child_start, False)
        ours = {t for t in open_files(os.getpid()) if t.startswith("socket:")} | {os.readlink(f"/proc/self/fd/{reaper_w}")}
        held = sorted(t for t in open_files(proc.pid) if t in ours)
        proc.kill()
        print(json.dumps({"method": method, "asked": os.environ["VLLM_WORKER_MULTIPROC_METHOD"],
                          "daemon_sockets": len(ours) - 1, "inherited": held}))
    asyncio.run(main())
"""


def test_the_engine_core_is_never_a_fork_of_the_daemon():
    """``VLLM_WORKER_MULTIPROC_METHOD=fork`` asked, as on a CUDA host without ``vllm serve``'s
    set-up: the engine core still starts with ``spawn`` and holds none of the daemon's sockets
    (listening, the loop's signal wake-up socket) nor the reaper pipe's write end."""
    out = run(ENGINE_CORE_START, env={"VLLM_WORKER_MULTIPROC_METHOD": "fork"}, timeout=180)
    assert out["asked"] == "fork" and out["daemon_sockets"] >= 3, out  # listener + the wake-up socketpair
    assert out["inherited"] == [], out
    assert out["method"] == "spawn", out


def test_spawn_is_preferred_unless_the_operator_chose():
    env: dict[str, str] = {}
    assert prefer_spawn(env) == "spawn" and env == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    env = {"VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    assert prefer_spawn(env) == "fork"  # the engine core's own children; the core itself is spawned
