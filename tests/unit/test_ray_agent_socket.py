"""The Ray agent's socket lives in the daemon's own ``multiprocessing`` directory (removed at
the daemon's exit, and by the crash reaper after a crash), not in one the agent makes: the
agent is killed at every stop, and a killed process removes nothing. Every daemon stop left a
``/tmp/pymp-*`` directory with a dead socket in it before (about 40 an hour under the
benchmarks). A real agent process, without Ray."""

from __future__ import annotations

import glob
import multiprocessing.util
import os
import tempfile

from config import load_settings
from executor.rayagent import RayAgent


def test_a_killed_agent_leaves_no_socket_and_no_directory():
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*")))
    mine = multiprocessing.util.get_temp_dir()  # this process's: what its exit removes
    agent = RayAgent(load_settings(None, {}).ray).spawn()
    try:
        address = agent._manager.address
        assert os.path.dirname(address) == mine, address
        assert agent.alive() and os.path.exists(address)
    finally:
        killed = agent.kill()
    assert killed and not agent.alive()
    assert not os.path.exists(address), "the killed agent's socket is still there"
    made = set(glob.glob(os.path.join(tempfile.gettempdir(), "pymp-*"))) - before - {mine}
    assert not made, f"directories the agent made and left: {made}"
