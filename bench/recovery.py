"""Recovery time, in one run on one machine:

1. the engine's cold start inside the warm daemon process (``ctl restart``'s engine_start phase);
2. kill → first token of the new engine in the daemon (``ray.kill`` of a worker mid-stream),
   and detection latency (kill → worker-death event) over ``--kills`` kills;
3. the anchor users have today: ``vllm serve`` whose worker is killed, restarted by a
   supervisor loop the way systemd would (``Restart=always``), until its first token.

    python -m bench.recovery --kills 20 --anchors 3
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import httpx

from bench.common import MODEL_NAME, VllmServe, base_parser, spread, start_daemon
from chaos import inject
from chaos.harness import BIN, RayHead
from chaos.load import first_token_after, run_with_fault


def first_token(base_url: str, deadline: float) -> float:
    """Poll with one-token requests until the server answers; the monotonic time it did."""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1},
                           timeout=30)
            if r.status_code == 200:
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("server never answered")


def anchor_process_restart(work: Path, head: RayHead, reps: int) -> list[float]:
    """vllm serve + a restart loop: kill a worker, wait for the process to exit, start it
    again (as systemd's Restart=always would), measure kill → first token."""
    times = []
    for i in range(reps):
        server = VllmServe(work, head).start()
        server.wait_ready()
        first_token(server.base_url, time.monotonic() + 60)
        killed = inject.kill_worker(head.address, match="")
        kill_at = killed["monotonic"]
        try:
            code = server.proc.wait(120)
        except subprocess.TimeoutExpired:
            code = "hung"
        server.stop()  # reaps it and removes the shared memory it left
        restarted = VllmServe(work, head)
        restarted.port, restarted.base_url = server.port, server.base_url
        restarted.cmd[restarted.cmd.index("--port") + 1] = str(server.port)
        restarted.start()
        got = first_token(restarted.base_url, time.monotonic() + 300)
        times.append(got - kill_at)
        print(f"anchor {i + 1}: vllm serve exited with {code}; kill → first token after restart {got - kill_at:.1f} s", flush=True)
        restarted.stop()
        time.sleep(2)
    return times


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--anchors", type=int, default=3)
    parser.add_argument("--cold-starts", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    head = RayHead(num_cpus=2).start()
    result: dict = {}
    try:
        daemon = start_daemon(work, head, tp=args.tp, max_model_len=1024, max_restarts=1000)
        daemon.wait_ready()
        socket = f"/tmp/vllm-supervisor-{daemon.port}.sock"
        cold = []
        for i in range(args.cold_starts):
            gen = daemon.status()["generation"]
            subprocess.run([str(BIN / "vllm-supervisor"), "ctl", "--socket", socket, "restart"], check=True, capture_output=True)
            s = daemon.wait_generation(gen + 1)
            cold.append(s["recoveries"][-1]["phases_s"]["engine_start"])
            print(f"cold start in the warm process {i + 1}: {cold[-1]:.1f} s", flush=True)
        detect, recover = [], []
        inject.prepare(head.address)  # a first ray.init + get_actor inside the fault takes seconds
        for i in range(args.kills):
            gen = daemon.status()["generation"]
            records, info = asyncio.run(run_with_fault(
                daemon.base_url, 4, 400, lambda: inject.kill_worker(head.address, rank=i % args.tp), offset=i))
            s = daemon.wait_generation(gen + 1)
            rec = s["recoveries"][-1]
            detect.append((rec["detected_monotonic"] - info["monotonic"]) * 1000)
            first = first_token_after(records, rec["ready_monotonic"])
            assert first is not None and all(r.outcome == "ok" for r in records), [r.error for r in records]
            recover.append(first - info["monotonic"])
            print(f"kill {i + 1}: detection {detect[-1]:.1f} ms, kill → first token {recover[-1]:.1f} s", flush=True)
        daemon.stop()
        anchors = anchor_process_restart(work, head, args.anchors) if args.anchors else []
    except BaseException:
        traceback.print_exc()  # before the head goes: a driver that loses its GCS may abort the process
        raise
    finally:
        inject.disconnect()
        head.stop()
    med = statistics.median
    lines = [
        f"Recovery, {time.strftime('%Y-%m-%d')}: TP={args.tp}, demo model on CPU, one run on one machine",
        "",
        "| measurement | n | min / median / max |",
        "| --- | --- | --- |",
        f"| engine cold start inside the warm daemon (s) | {len(cold)} | {spread(cold)} |",
        f"| daemon: kill → first token of the new engine (s) | {len(recover)} | {spread(recover)} |",
        f"| detection latency: kill → worker-death event (ms) | {len(detect)} | {spread(detect)} |",
    ]
    if anchors:
        lines.append(f"| vllm serve + restart loop: kill → first token (s) | {len(anchors)} | {spread(anchors)} |")
    lines += ["", f"- daemon recovery / engine cold start: **{med(recover) / med(cold):.2f}** (goal ≤ 1.05)"]
    if anchors:
        lines.append(f"- daemon recovery / process restart: **{med(recover) / med(anchors):.2f}** (goal ≤ 0.5)")
    text = "\n".join(lines) + "\n"
    result = {"cold_start_s": cold, "recovery_s": recover, "detect_ms": detect, "process_restart_s": anchors}
    (args.out / "recovery.md").write_text(text)
    (args.out / "recovery.json").write_text(json.dumps(result, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
