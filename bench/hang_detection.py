"""Hang detection by engine steps, shown on a prefill longer than the hang timeout.

The demo model is too small for a slow prefill, so this builds a larger random Llama beside it
(``--hidden``/``--layers``, the demo model's tokenizer; cached in the data directory) and serves
it with the daemon on a Ray head, defaults but ``--max-num-batched-tokens`` (the prefill chunk).
Then, in one run:

1. a prompt of ``--prompt-tokens`` tokens, alone: its prefill takes many steps and no token for
   longer than ``hang_timeout_s`` (4 s by default). Its time to first token is measured and no
   recovery may follow (the step clock sees the chunks);
2. the same on a second daemon built without the step clock (the test hook
   ``VLLM_SUPERVISOR_TEST_TOKEN_CLOCK``: tokens are the probe's clock, as before): the prefill
   is taken for a hang, and the client goes at the first recovery. (``--disable-log-stats``
   is no such control: vLLM turns its stats back on for the daemon's registered logger.)
3. on the first daemon, ``--streams`` decoding streams and a SIGSTOP of the worker: the time from
   the signal to the recovery's detection (the hang's ``detected_monotonic``), ``--stops`` times.

    python -m bench.hang_detection --out bench/results
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import base_parser
from config import SupervisorSettings
from chaos import inject
from chaos.harness import OPERATOR_ENV, Daemon, RayHead, data_dir, demo_model_path
from chaos.load import run_with_fault
from supervisor import testhooks

NAME = "slow-llama"


def slow_model(hidden: int, layers: int, max_len: int) -> Path:
    """A random Llama of ``hidden`` × ``layers`` with the demo model's tokenizer (built once)."""
    out = data_dir() / f"{NAME}-h{hidden}-l{layers}-m{max_len}"
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = Path(tempfile.mkdtemp(dir=data_dir()))
    demo = demo_model_path()
    for f in demo.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, tmp / f.name)
    demo_cfg = json.loads((demo / "config.json").read_text())
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256), intermediate_size=hidden * 11 // 4,
                         vocab_size=demo_cfg["vocab_size"], max_position_embeddings=max_len, tie_word_embeddings=False,
                         bos_token_id=demo_cfg.get("bos_token_id"), eos_token_id=demo_cfg.get("eos_token_id"),
                         pad_token_id=demo_cfg.get("pad_token_id"))
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {**json.loads((tmp / "tokenizer_config.json").read_text()), "model_max_length": max_len}))
    tmp.rename(out)
    return out


def start(work: Path, head: RayHead, model: Path, args, token_clock: bool = False) -> Daemon:
    """The daemon (standby none) on ``model``; with ``token_clock``, built without the step clock
    (the test hook: tokens are the probe's clock, as before it)."""
    config = {"ray": {"address": head.address}, "supervisor": {"standby": "none", "max_restarts": 20}}
    flags = (str(model), "--served-model-name", NAME, "--max-model-len", str(args.max_len), "--dtype", "float32",
             "--enforce-eager", "--max-num-batched-tokens", str(args.chunk))
    env = dict(OPERATOR_ENV, **({testhooks.ENV: "1", testhooks.TOKEN_CLOCK_ENV: "1"} if token_clock else {}))
    daemon = Daemon(work, config, env=env, args=flags).start()
    daemon.wait_ready(timeout_s=600)
    return daemon


def long_prompt(daemon: Daemon, n: int, until_recovery: bool = False) -> dict[str, Any]:
    """One completion of a prompt of ``n`` token ids, streamed: its time to first token, and the
    recoveries it caused (with ``until_recovery``: only until the first, then the client goes)."""
    import threading

    ids = [random.Random(7).randrange(3, 500) for _ in range(n)]
    before = len(daemon.status()["recoveries"])
    started = time.monotonic()
    first: list[float] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", daemon.base_url + "/v1/completions", timeout=600,
                              json={"model": NAME, "prompt": ids, "max_tokens": 4, "stream": True,
                                    "ignore_eos": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and not first:
                        first.append(time.monotonic() - started)
                    if until_recovery and done.is_set():
                        return
        except httpx.HTTPError:
            pass

    done = threading.Event()
    client = threading.Thread(target=stream, daemon=True)
    client.start()
    recoveries: list[dict] = []
    while client.is_alive():
        client.join(0.5)
        recoveries = daemon.status()["recoveries"][before:]
        if until_recovery and recoveries:
            done.set()
            break
    return {"ttft_s": round(first[0], 2) if first else None,
            "recoveries": [(x["reason"], x["detail"][:90]) for x in recoveries],
            "detected_after_s": [round(x["detected_monotonic"] - started, 2) for x in recoveries if x.get("detected_monotonic")]}


def stop_a_worker(daemon: Daemon, head: RayHead, streams: int) -> float:
    """SIGSTOP the worker under ``streams`` decoding streams; seconds until the hang was detected."""
    before = daemon.status()["generation"]
    records, info = asyncio.run(run_with_fault(
        daemon.base_url, streams, 200, lambda: inject.signal_worker(head.address, signal.SIGSTOP, rank=0), model=NAME))
    s = daemon.wait_generation(before + 1)
    rec = s["recoveries"][-1]
    assert rec["reason"] == "hang", rec
    assert all(r.outcome == "ok" for r in records), [(r.outcome, r.error[:80]) for r in records]
    return rec["detected_monotonic"] - info["monotonic"]


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=256, help="--max-num-batched-tokens: the prefill chunk")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stops", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = slow_model(args.hidden, args.layers, args.max_len)
    report: dict[str, Any] = {"model": model.name, "prompt_tokens": args.prompt_tokens, "chunk": args.chunk}
    head = RayHead(num_cpus=2).start()
    try:
        with tempfile.TemporaryDirectory(prefix="hang-") as tmp:
            (Path(tmp) / "steps").mkdir()
            (Path(tmp) / "tokens").mkdir()
            with start(Path(tmp) / "steps", head, model, args) as daemon:
                inject.prepare(head.address)
                report["steps_long_prompt"] = long_prompt(daemon, args.prompt_tokens)
                print("step clock, long prompt:", report["steps_long_prompt"], flush=True)
                report["detect_s"] = [round(stop_a_worker(daemon, head, args.streams), 2) for _ in range(args.stops)]
                print("SIGSTOP detected after", report["detect_s"], flush=True)
                daemon.stop()
            with start(Path(tmp) / "tokens", head, model, args, token_clock=True) as daemon:
                report["tokens_long_prompt"] = long_prompt(daemon, args.prompt_tokens, until_recovery=True)
                print("token clock (test hook), long prompt:", report["tokens_long_prompt"], flush=True)
                daemon.stop()
    finally:
        inject.disconnect()
        head.stop()
    d = report["detect_s"]
    text = "\n".join([
        f"# Hang detection by engine steps ({time.strftime('%Y-%m-%d')}; {model.name}, TP=1, "
        f"--max-num-batched-tokens {args.chunk}, hang_timeout_s {SupervisorSettings().hang_timeout_s:g} (default))", "",
        "| case | result |", "| --- | --- |",
        f"| a {args.prompt_tokens}-token prompt, step clock (default) | first token after {report['steps_long_prompt']['ttft_s']} s; "
        f"recoveries: {report['steps_long_prompt']['recoveries'] or 'none'} |",
        f"| the same, without the step clock (test hook: tokens are the clock) | "
        f"first recovery detected {(report['tokens_long_prompt']['detected_after_s'] or ['never'])[0]} s after the request; "
        f"recoveries: {report['tokens_long_prompt']['recoveries'] or 'none'} |",
        f"| SIGSTOP of the worker under {args.streams} decoding streams: signal → hang detected | "
        f"{' / '.join(f'{x:.2f}' for x in d)} s (median {statistics.median(d):.2f} s) |", ""])
    (args.out / "hang-detection.md").write_text(text)
    (args.out / "hang-detection.json").write_text(json.dumps(report, indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
