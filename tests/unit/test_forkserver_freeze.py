"""A child of the engine core's fork server starts with what the server imported frozen out
of the garbage collector's walks (``executor.forkserver.EnvReplayProcess``): the engine core's
collections then walk only what its build made. A real fork server, with a light preload."""

from __future__ import annotations

import gc

from executor import forkserver


def report_frozen(path: str) -> None:
    """The child's side: how many objects it starts with frozen."""
    with open(path, "w") as f:
        f.write(str(gc.get_freeze_count()))


def test_a_fork_server_child_starts_with_the_servers_imports_frozen(tmp_path):
    out = tmp_path / "frozen"
    forkserver.start(["json", "email.message"])
    try:
        child = forkserver._CONTEXT.Process(target=report_frozen, args=(str(out),), daemon=True)
        child.start()
        child.join(60)
        assert child.exitcode == 0
    finally:
        forkserver.stop()
    assert int(out.read_text()) > 10_000, "the child's inherited heap is not frozen"
    assert forkserver.pid() is None
