"""CI smoke: the README's first command, and systemd's, exactly as a new user runs them.

    .venv/bin/python .ci/smoke.py make-run   # `make run` in a scrubbed environment
    .venv/bin/python .ci/smoke.py systemd    # the unit's ExecStart= with its Environment=
    .venv/bin/python .ci/smoke.py wheel      # the wheel: build, twine check, pip install, serve

The ``wheel`` form first builds the wheel and the sdist (``python -m build``) from a copy of the
checkout, runs ``twine check --strict`` on both, installs the wheel with the host's extra
(``pip install 'vllm_supervisor-*.whl[cpu]' -c constraints/cpu.txt``, the README's pip route, with
the CPU torch from a local wheel if pip finds one, else from ``TORCH_INDEX`` as ``make venv`` does)
into a fresh venv outside the checkout, checks that ``vllm-supervisor assets`` prints each
operator's file as the checkout has it, then serves from that venv (from a directory outside the
checkout) as below, and deletes the venv (3.7 GB). ``tests/integration/test_install.py`` runs it
(``make extended``, so CI).

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
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos.leaks import Leaks  # noqa: E402

READY_TIMEOUT_S = 900  # a first build on a cold 2-core machine: demo model + engine, ~1-2 min
INSTALL_TIMEOUT_S = 1800  # pip install of the wheel: ~2.5 min here, more on a cold cache from PyPI
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"  # as the Makefile's TORCH_INDEX
# vllm-supervisor assets NAME -> the checkout's file it must print
ASSETS = {"systemd-unit": "systemd/vllm-supervisor.service", "env-file": "systemd/vllm-supervisor.env",
          "ray-head-unit": "systemd/ray-head.service", "systemd-readme": "systemd/README.md",
          "grafana": "health/grafana/vllm-supervisor.json", "alerts": "health/alerts/vllm-supervisor.rules.yml"}


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


def flavor() -> str:
    """The Makefile's FLAVOR: gpu when ``nvidia-smi -L`` answers, else cpu."""
    try:
        ok = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "gpu" if ok else "cpu"


def step(argv: list, log: Path, timeout: float = INSTALL_TIMEOUT_S, **kw) -> str:
    """Run one install step, its output appended to ``log``; fail with the log's tail if it fails."""
    argv = [str(a) for a in argv]
    started = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(argv)}\n{out.stdout}{out.stderr}")
    if out.returncode != 0:
        fail(f"exit {out.returncode}: {shlex.join(argv)}", log)
    print(f"  {time.monotonic() - started:.0f} s: {shlex.join(argv)[:160]}")
    return out.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_copy(dest: Path) -> Path:
    """The checkout's files (tracked, and new ones not ignored), without .venv, caches or build output."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (r.decode() for r in listed)):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def torch_index_args(python: Path, extra: str) -> list[str]:
    """What ``make venv`` adds for the CPU torch: nothing if pip finds the pinned torch without an
    index (a local wheel), else ``--extra-index-url $TORCH_INDEX``."""
    index = os.environ.get("TORCH_INDEX", TORCH_INDEX)
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints/cpu.txt").read_text(), re.M)
    if extra != "cpu" or not index:
        return []
    local = subprocess.run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--no-index", "--no-deps",
                            "--ignore-installed", f"torch=={pin.group(1)}" if pin else "torch"], capture_output=True)
    return [] if local.returncode == 0 else ["--extra-index-url", index]


def wheel_install(work: Path, log: Path) -> Path:
    """Build, check and install the wheel into ``work/venv``; return the venv."""
    dist = work / "dist"
    src = checkout_copy(work / "src")
    print("wheel: python -m build, twine check, pip install into a fresh venv")
    step([sys.executable, "-m", "build", "--outdir", dist, src], log)
    built_from = {name: (src / rel).read_bytes() for name, rel in ASSETS.items()}  # the checkout as it was copied
    shutil.rmtree(src)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(f"want one wheel and one sdist in {dist}: {sorted(p.name for p in dist.iterdir())}", log)
    members = zipfile.ZipFile(wheels[0]).namelist()  # package data as in the checkout, systemd/ under share/
    shared = ".data/data/share/vllm-supervisor/"
    lacking = [rel for rel in ASSETS.values() if rel not in members and not any(m.endswith(shared + rel) for m in members)]
    if lacking:
        fail(f"the wheel {wheels[0].name} lacks {lacking}", log)
    step([sys.executable, "-m", "twine", "check", "--strict", wheels[0], sdists[0]], log)
    print(f"  twine check --strict passed: {wheels[0].name}, {sdists[0].name}")
    venv = work / "venv"
    extra = flavor()
    step([sys.executable, "-m", "venv", venv], log)
    python = venv / "bin" / "python"
    step([python, "-m", "pip", "install", "--upgrade", "--quiet", "pip"], log)
    step([python, "-m", "pip", "install", *torch_index_args(python, extra), "-c", ROOT / f"constraints/{extra}.txt",
          f"{wheels[0]}[{extra}]"], log)
    if extra == "cpu":  # as make venv does: PyPI's CUDA builds of these fail to load beside the CPU torch
        step([python, "-m", "pip", "uninstall", "--yes", "--quiet", "torchvision", "torchaudio", "torchcodec"], log)
    for name, rel in ASSETS.items():
        printed = subprocess.run([str(venv / "bin/vllm-supervisor"), "assets", name], cwd=work, capture_output=True,
                                 env=scrubbed_env(work))  # no PYTHONPATH: the wheel's files, not the checkout's
        if printed.returncode != 0 or printed.stdout != built_from[name]:
            fail(f"`vllm-supervisor assets {name}` from the wheel (exit {printed.returncode}) does not print {rel}: "
                 f"{printed.stderr.decode(errors='replace')[-500:]}", log)
    print(f"  vllm-supervisor assets: {', '.join(ASSETS)} (each as the checkout has it)")
    return venv


def smoke(form: str) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"smoke-{form}-"))
    home = work / "home"
    home.mkdir()
    log = work / "daemon.log"
    cwd = ROOT
    venv = None
    if form == "wheel":  # before the leak snapshot: the build and pip leave nothing running
        try:
            venv = wheel_install(work, work / "install.log")
        except BaseException:
            shutil.rmtree(work / "venv", ignore_errors=True)
            raise
        cwd = work / "run"  # outside the checkout: nothing of it can be imported
        cwd.mkdir()
    leaks = Leaks(top_sockets=True)  # vLLM's ZeroMQ sockets too: the daemon leaves none in /tmp
    stop_notify = None
    if form == "make-run":
        argv, env, base_url = ["make", "run"], scrubbed_env(home), "http://127.0.0.1:8000"
    elif form == "wheel":
        env = scrubbed_env(home)
        env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"  # as an activated venv
        port = free_port()  # the demo model default otherwise; a free port beside other daemons on this host
        argv, base_url = [str(venv / "bin/vllm-supervisor"), "serve", "--port", str(port)], f"http://127.0.0.1:{port}"
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
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=False)
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
        if venv is not None:
            shutil.rmtree(venv, ignore_errors=True)  # 3.7 GB
    shutil.rmtree(work, ignore_errors=True)  # passed: its log and home are not needed (a failure keeps them)


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
    unknown = set(forms) - {"make-run", "systemd", "wheel"}
    if unknown:
        sys.exit(f"unknown form(s) {sorted(unknown)}: make-run, systemd, wheel")
    for form in forms:
        smoke(form)
    print("smoke passed:", ", ".join(forms))
