"""The control socket's access rules on the real server (``serve_control``): only this user
may connect, a live socket is never taken over by a second daemon, a stale one is."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from supervisor.control import request, serve_control, socket_answers

NOBODY = 65534


async def _status() -> dict:
    return {"state": "ready"}


async def _submit(cmd: str, args: dict) -> dict:
    return {"ok": True}


def connect_as(uid: int, path: str) -> int:
    """errno of a connect() to ``path`` from a child running as ``uid`` (0: connected)."""
    pid = os.fork()
    if pid == 0:  # the child: drop to uid, try, report through the exit status
        code = 0
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
        except OSError as exc:
            code = exc.errno or 255
        os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


async def started(path: str) -> asyncio.Task:
    """The real control server on ``path``, once its socket exists."""
    server = asyncio.create_task(serve_control(path, _status, _submit))
    for _ in range(100):
        if Path(path).exists():
            break
        await asyncio.sleep(0.02)
    return server


@pytest.fixture
def open_dir():
    """A directory anyone may enter: only the socket's own mode can refuse a connect."""
    d = Path(tempfile.mkdtemp(prefix="vsup-ctl-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_only_this_user_may_connect_and_a_live_socket_is_not_taken_over(open_dir):
    path = str(open_dir / "control.sock")

    async def main() -> None:
        server = await started(path)
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert socket_answers(path)
        # a second daemon configured with the same path returns at once and leaves it alone
        await asyncio.wait_for(serve_control(path, _status, _submit), 5)
        reply = await asyncio.to_thread(request, path, "status", None, 5)
        assert reply == {"ok": True, "status": {"state": "ready"}}
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        assert not Path(path).exists()  # removed on the way out

    asyncio.run(main())


def test_a_stale_socket_is_replaced(open_dir):
    path = str(open_dir / "control.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)  # what a killed daemon leaves: a socket file nobody listens on
    assert not socket_answers(path)

    async def main() -> None:
        server = asyncio.create_task(serve_control(path, _status, _submit))
        await asyncio.sleep(0.3)
        reply = await asyncio.to_thread(request, path, "status", None, 5)
        assert reply["ok"]
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.skipif(os.getuid() != 0, reason="becoming another user needs root (CI runs as root)")
def test_another_user_is_refused(open_dir):
    path = str(open_dir / "control.sock")

    async def main() -> None:
        server = await started(path)
        assert await asyncio.to_thread(connect_as, NOBODY, path) == errno.EACCES
        os.chmod(path, 0o666)  # the control: the mode is what refuses
        assert await asyncio.to_thread(connect_as, NOBODY, path) == 0
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())


def test_ray_env_gives_this_user_the_clusters_address_and_token(open_dir, monkeypatch, capsys):
    """``ctl ray-env``: the export lines a Ray client (the ray CLI, ``chaos.inject``) needs to
    join the daemon's cluster, its private one included (whose token exists only in the
    daemon's environment); only what is set."""
    from supervisor.control import main as ctl

    path = str(open_dir / "control.sock")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a b'c")  # quoted for a shell
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)

    async def main() -> None:
        server = await started(path)
        assert await asyncio.to_thread(ctl, ["--socket", path, "ray-env"]) == 0
        monkeypatch.delenv("RAY_AUTH_TOKEN")
        reply = await asyncio.to_thread(request, path, "ray-env", None, 5)
        assert reply == {"ok": True, "env": {"RAY_ADDRESS": "127.0.0.1:6379", "RAY_AUTH_MODE": "token"}}
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)

    asyncio.run(main())
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("export")] == [
        "export RAY_ADDRESS=127.0.0.1:6379", "export RAY_AUTH_MODE=token", "export RAY_AUTH_TOKEN='a b'\"'\"'c'"]
