"""A stop sent to the daemon's whole process group, as a shell's job control (``kill %1``,
Ctrl-C at the terminal), ``timeout`` and ``kill -- -PGID`` send it: every process of the group
gets the signal at once, Ray's head, its agents and workers and vLLM's engine core included,
not the daemon alone as systemd's ``KillMode=mixed`` does. The daemon still exits 0 and leaves
nothing behind: no process, no ``/dev/shm`` segment, no socket. (A Ray ``RuntimeEnvAgent`` outlived
such a stop of ``make run`` by a minute and a half once, early on 2026-12-03; five tries since were clean in 4-6 s.)"""

from __future__ import annotations

import signal

import httpx
import pytest

from chaos.harness import Daemon

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.extended)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_leaves_nothing(tmp_path, sig):
    config = {"engine": {"tensor_parallel_size": 1, "max_model_len": 1024}}
    with Daemon(tmp_path, config, own_session=True).start() as d:
        d.wait_ready()
        d.wait_standby()  # the defaults' every process: the standby's worker and fork server too
        r = d.post("/v1/completions", json={"model": "demo-tiny-llama", "prompt": "hello", "max_tokens": 4})
        assert r.status_code == 200, r.text
        code, _ = d.stop(sig, group=True)
        assert code == 0, d.tail()
        d.assert_nothing_left()
        with pytest.raises(httpx.HTTPError):
            d.get("/livez", timeout=2)
