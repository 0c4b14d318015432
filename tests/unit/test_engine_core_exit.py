"""A spawned engine core ends as a fork-server child does (``executor.forkserver.
EngineCoreSpawnProcess``): its exit code is kept, the exit hooks run (Ray's driver is
disconnected without its half-second wait for the log lines it relays), and the interpreter's
teardown, 1.5 s with torch and vLLM imported, is skipped. A real spawned child; Ray's worker
module is a stand-in that records how it was shut down."""

from __future__ import annotations

import json
import sys
import types

import pytest

from executor import forkserver


class _WritesOnTeardown:
    """Writes a file when collected, which happens in an interpreter's teardown."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self, _open=open) -> None:  # late in a teardown, the builtins are gone
        with _open(self.path, "w") as f:
            f.write("torn down")


_KEEP = []


def child(out_dir: str, code: int) -> None:
    import atexit

    calls = []
    fake = types.ModuleType("ray._private.worker")

    def shutdown(_exiting_interpreter: bool = False) -> None:
        calls.append(_exiting_interpreter)

    fake.shutdown = shutdown
    sys.modules["ray._private.worker"] = fake
    # registered first, so run last: after Ray's own hook, had it stayed registered
    atexit.register(lambda: open(f"{out_dir}/after", "w").write(json.dumps(calls)))
    atexit.register(fake.shutdown, _exiting_interpreter=True)  # as Ray registers it at import
    _KEEP.append(_WritesOnTeardown(f"{out_dir}/teardown"))
    if code:
        raise SystemExit(code)


@pytest.mark.parametrize("code", [0, 3])
def test_a_spawned_engine_core_keeps_its_exit_code_runs_its_hooks_and_skips_the_teardown(tmp_path, code):
    proc = forkserver._SPAWN.Process(target=child, args=(str(tmp_path), code), daemon=True)
    proc.start()
    proc.join(60)
    assert proc.exitcode == code
    # the hooks ran, and Ray's driver was disconnected once, not as an exiting interpreter
    assert json.loads((tmp_path / "after").read_text()) == [False]
    assert not (tmp_path / "teardown").exists(), "the interpreter's teardown ran"


def test_the_engine_core_context_is_still_spawn():
    assert forkserver._SPAWN.get_start_method() == "spawn"
    assert issubclass(forkserver._SPAWN.Process, forkserver.EngineCoreSpawnProcess)
