"""``executor.cluster.kill_named`` on a real Ray cluster: the Ray agent kills a leftover worker
by name without importing the worker's class (vLLM and torch), and a real handle to an actor
of the same class built afterwards in the same process still has its methods."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

CREATOR = """
import ray, sys, time
from victim_mod import Victim
ray.init(address=sys.argv[1], namespace="kill-named-test", log_to_driver=False)
actors = [Victim.options(name=n).remote() for n in ("victim", "other")]
ray.get([a.ping.remote() for a in actors])
print("ready", flush=True)
time.sleep(300)
"""

KILLER = """
import sys, time
import ray
from ray._private import state
from executor.cluster import kill_named

ray.init(address=sys.argv[1], namespace="kill-named-test", log_to_driver=False)
kill_named("victim", "kill-named-test")
assert "victim_mod" not in sys.modules, "the actor's class was imported"
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    states = {v["Name"]: v["State"] for v in state.actors().values() if v.get("Name") in ("victim", "other")}
    if states.get("victim") == "DEAD":
        break
    time.sleep(0.2)
assert states == {"victim": "DEAD", "other": "ALIVE"}, states
try:
    kill_named("victim", "kill-named-test")
except ValueError:
    pass
else:
    raise AssertionError("a dead actor's name still resolved")
sys.path.insert(0, sys.argv[2])  # now the class can be imported: a full handle must work
other = ray.get_actor("other", namespace="kill-named-test")
assert ray.get(other.ping.remote()) == "pong"
print("ok", flush=True)
"""


def test_kill_by_name_without_the_actor_class(ray_head, tmp_path):
    (tmp_path / "victim_mod.py").write_text(textwrap.dedent("""
        import ray

        @ray.remote(num_cpus=0)
        class Victim:
            def ping(self):
                return "pong"
    """))
    env = dict(ray_head.env, PYTHONPATH=str(tmp_path))
    creator = subprocess.Popen([sys.executable, "-c", CREATOR, ray_head.address], env=env, cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in creator.stdout:
            lines.append(line)
            if line.strip() == "ready":
                break
        assert lines and lines[-1].strip() == "ready", "".join(lines)[-3000:]
        killer_env = dict(ray_head.env, PYTHONPATH=str(ROOT))  # not the class's directory
        out = subprocess.run([sys.executable, "-c", KILLER, ray_head.address, str(tmp_path)], env=killer_env,
                             cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.stdout + out.stderr)[-3000:]
    finally:
        creator.kill()
        creator.wait(30)
