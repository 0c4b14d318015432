"""Serving overhead: the daemon vs. ``vllm serve`` on the same model, executor and Ray cluster,
measured with the same client (``vllm bench serve``, random dataset, fixed seed and rate),
alternating the two several times. Prints per-metric ratios daemon / vllm serve.

    python -m bench.serving_overhead --rounds 3
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path

from bench.common import VllmServe, base_parser, bench_serve, spread, start_daemon
from chaos import inject
from chaos.harness import RayHead

METRICS = [
    ("request_throughput", "request throughput", "higher"),
    ("output_throughput", "output token throughput", "higher"),
    ("p50_ttft_ms", "TTFT p50", "lower"),
    ("p99_ttft_ms", "TTFT p99", "lower"),
    ("p50_itl_ms", "ITL p50", "lower"),
    ("p99_itl_ms", "ITL p99", "lower"),
]


def main() -> int:
    parser = base_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--rate", type=float, default=16.0)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    head = RayHead(num_cpus=2).start()
    runs: dict[str, list[dict]] = {"vllm_serve": [], "daemon": []}
    try:
        for r in range(args.rounds):
            for kind in ("vllm_serve", "daemon"):
                if kind == "vllm_serve":
                    server = VllmServe(work, head).start()
                    server.wait_ready()
                    url = server.base_url
                else:
                    (work / f"d{r}").mkdir()
                    server = start_daemon(work / f"d{r}", head)
                    server.wait_ready()
                    url = server.base_url
                # one short warm-up so both start from a warm engine
                bench_serve(url, work, f"warmup-{kind}-{r}", 8, float("inf"), args.input_len, args.output_len, seed=99)
                result = bench_serve(url, work, f"{kind}-{r}", args.num_prompts, args.rate, args.input_len,
                                     args.output_len, seed=0)
                assert result["failed"] == 0, result
                runs[kind].append(result)
                server.stop()
                print(f"round {r + 1} {kind}: {result['output_throughput']:.0f} tok/s, "
                      f"TTFT p50 {result['p50_ttft_ms']:.1f} ms, ITL p50 {result['p50_itl_ms']:.2f} ms", flush=True)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        inject.disconnect()
        head.stop()
    rows = []
    for key, label, better in METRICS:
        ratios = [d[key] / v[key] for d, v in zip(runs["daemon"], runs["vllm_serve"]) if v[key]]
        rows.append({"metric": label, "better": better, "ratios": ratios,
                     "vllm_serve": [v[key] for v in runs["vllm_serve"]], "daemon": [d[key] for d in runs["daemon"]]})
    table = [
        f"Serving overhead, {time.strftime('%Y-%m-%d')}: {args.rounds} alternating rounds, {args.num_prompts} prompts "
        f"at {args.rate:g} req/s, {args.input_len} in / {args.output_len} out tokens, TP=1, demo model on CPU",
        "",
        "| metric | ratio daemon / vllm serve (min / median / max) | vllm serve (median) | daemon (median) |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        table.append(f"| {row['metric']} ({row['better']} is better) | {spread(row['ratios'])} | "
                     f"{statistics.median(row['vllm_serve']):.2f} | {statistics.median(row['daemon']):.2f} |")
    table += [
        "", "Each round (output tok/s, TTFT p50 ms, ITL p50 ms):", "",
        "| round | vllm serve | daemon |", "| --- | --- | --- |",
        *[f"| {i + 1} | {v['output_throughput']:.0f}, {v['p50_ttft_ms']:.1f}, {v['p50_itl_ms']:.2f} | "
          f"{d['output_throughput']:.0f}, {d['p50_ttft_ms']:.1f}, {d['p50_itl_ms']:.2f} |"
          for i, (v, d) in enumerate(zip(runs["vllm_serve"], runs["daemon"]))],
    ]
    text = "\n".join(table) + "\n"
    (args.out / "serving_overhead.md").write_text(text)
    (args.out / "serving_overhead.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
