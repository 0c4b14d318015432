"""CI smoke: the README's first command, and systemd's, exactly as a new user runs them.

    .venv/bin/python .ci/smoke.py make-run   # `make run` in a scrubbed environment
    .venv/bin/python .ci/smoke.py systemd    # the unit's ExecStart= with its Environment=

Each starts the daemon with nothing but ``PATH`` and an empty ``HOME`` (``env -i``; systemd's
form adds what the unit file and its environment file set), waits for ``/readyz`` 200, asks
for one completion and one chat answer through the ``openai`` SDK, sends SIGTERM, expects exit
0 and that nothing it started is left: no process of this session started since, no new
``/dev/shm`` entry. Exits non-zero with the daemon's log tail otherwise.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos.leaks import Leaks  # noqa: E402

READY_TIMEOUT_S = 900  # a first build on a cold 2-core machine: demo model + engine, ~1-2 min


def scrubbed_env(home: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(home)}


def unit_command(home: Path, config: Path) -> tuple[list[str], dict[str, str]]:
    """The unit's ExecStart= (install paths mapped to this checkout) and the environment systemd
    gives it: its Environment= lines and the shipped EnvironmentFile, HOME and data dir mapped
    to ``home``."""
    unit = (ROOT / "systemd/vllm-supervisor.service").read_text()
    env = scrubbed_env(home)
    for line in (ROOT / "systemd/vllm-supervisor.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    for key, value in re.findall(r"^Environment=(\w+)=(.*)$", unit, re.M):
        env[key] = str(home) if value.startswith("/var/lib/vllm-supervisor") else value
    exec_start = re.search(r"^ExecStart=(.*)$", unit, re.M).group(1)
    exec_start = exec_start.replace("/opt/vllm-supervisor/", f"{ROOT}/").replace("/etc/vllm-supervisor/config.toml", str(config))
    argv = [w for w in shlex.split(exec_start) if w != "$VLLM_SERVE_ARGS"]  # empty in the shipped file: the demo model
    return argv, env


def notify_socket(path: Path) -> tuple[list[str], threading.Event]:
    """A datagram socket standing in for systemd's NOTIFY_SOCKET; collects the messages."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    messages: list[str] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            try:
                messages.append(sock.recv(65536).decode())
            except socket.timeout:
                continue
        sock.close()

    threading.Thread(target=read, daemon=True).start()
    return messages, stop


def wait_ready(proc: subprocess.Popen, base_url: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            fail(f"exited with {proc.returncode} before /readyz answered 200", log)
        try:
            r = httpx.get(base_url + "/readyz", timeout=2)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(1)
    fail(f"/readyz not 200 within {READY_TIMEOUT_S} s (last: {last[:300]})", log)


def talk(base_url: str, log: Path) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The daemon says", max_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=8, temperature=0)
    if not (done.choices[0].text and done.usage.completion_tokens == 8):
        fail(f"completion: {done}", log)
    if not (chat.choices[0].message.content and chat.usage.completion_tokens == 8):
        fail(f"chat: {chat}", log)
    print(f"  completion {done.choices[0].text!r}, chat {chat.choices[0].message.content!r}")


def fail(why: str, log: Path) -> None:
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:]) if log.exists() else ""
    print(f"SMOKE FAILED: {why}\n--- log tail ---\n{tail}", file=sys.stderr)
    sys.exit(1)


def smoke(form: str) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"smoke-{form}-"))
    home = work / "home"
    home.mkdir()
    log = work / "daemon.log"
    leaks = Leaks()
    stop_notify = None
    if form == "make-run":
        argv, env, base_url = ["make", "run"], scrubbed_env(home), "http://127.0.0.1:8000"
    else:
        config = work / "config.toml"
        config.write_text("")  # the install notes' "may be empty"
        argv, env = unit_command(home, config)
        messages, stop_notify = notify_socket(work / "notify.sock")
        env["NOTIFY_SOCKET"] = str(work / "notify.sock")
        base_url = "http://127.0.0.1:8000"
    print(f"{form}: {shlex.join(argv)}\n  environment: {sorted(env)}")
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=False)
    try:
        wait_ready(proc, base_url, log)
        print(f"  /readyz 200 after {time.monotonic() - started:.0f} s")
        talk(base_url, log)
        if stop_notify is not None and "READY=1" not in "\n".join(messages):
            fail(f"no READY=1 sent to NOTIFY_SOCKET: {messages}", log)
        # make forwards nothing: the daemon is make's child; SIGTERM goes to it as systemd would send it
        daemon = daemon_pid(proc)
        os.kill(daemon, signal.SIGTERM)
        code = proc.wait(120)
        if code != 0:
            fail(f"exit {code} after SIGTERM (want 0)", log)
        left = leaks.wait_clean(settle_s=30)
        if left:
            fail(f"left behind after SIGTERM: {left}", log)
        print(f"  SIGTERM: exit 0, nothing left ({time.monotonic() - started:.0f} s in all)")
    finally:
        if proc.poll() is None:
            proc.kill()
        leaks.kill_new()
        if stop_notify is not None:
            stop_notify.set()


def daemon_pid(proc: subprocess.Popen) -> int:
    """The daemon: ``proc`` itself, or under ``make``, its ``vllm-supervisor serve`` child."""
    from executor.reaper import descendants

    for pid, _ in sorted(descendants(proc.pid)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"vllm-supervisor") for part in cmd) and b"serve" in cmd:
            return pid
    return proc.pid


if __name__ == "__main__":
    forms = sys.argv[1:] or ["make-run", "systemd"]
    for form in forms:
        smoke(form)
    print("smoke passed:", ", ".join(forms))
