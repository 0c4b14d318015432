"""The front's cProfile stats per output token: by where the code lives, and the functions whose
own time differs most between the servers. python analyse.py OUTDIR"""
import glob, pstats, sys, collections
from pathlib import Path
out = Path(sys.argv[1])
def group(path, name):
    for key in ("/supervisor/", "/executor/", "/health/", "/config/"):
        if key in path: return "ours" + key.rstrip("/")
    for key in ("vllm/entrypoints", "vllm/v1/engine", "vllm/tokenizers", "vllm/transformers_utils", "vllm/v1/metrics", "vllm/",
                "starlette", "fastapi", "uvicorn", "pydantic", "prometheus_client", "structlog", "zmq", "msgspec", "asyncio",
                "tokenizers", "transformers", "json", "logging", "typing", "copy", "uuid"):
        if key in path: return key
    if path == "~": return "builtins:" + name.split(" ")[0][:40]
    return "other:" + Path(path).name
per = {}
for tok in sorted(out.glob("*.tokens")):
    tokens, pid = tok.read_text().split()
    stats = pstats.Stats(f"{str(tok)[:-7]}.{pid}")
    groups, funcs, calls = collections.Counter(), {}, collections.Counter()
    for (path, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        g = group(path, name)
        groups[g] += tt
        funcs[f"{Path(path).parent.name}/{Path(path).name}:{line}:{name}" if path != "~" else name] = (tt, nc)
    per[tok.stem] = (int(tokens), groups, funcs, stats.total_tt)
for k, (tokens, groups, funcs, total) in per.items():
    print(f"== {k}: {tokens} tokens, own time {total:.2f} s = {1e6*total/tokens:.1f} us/token")
kinds = sorted({k.rsplit('-r', 1)[0] for k in per})
def mean(kind, f):
    vals = [f(v) for k, v in per.items() if k.rsplit('-r', 1)[0] == kind]
    return sum(vals) / len(vals)
allg = sorted({g for v in per.values() for g in v[1]}, key=lambda g: -max(mean(kd, lambda v: v[1][g] / v[0]) for kd in kinds))
print("\nus per output token by group (mean of rounds):", " | ".join(kinds))
for g in allg[:40]:
    vals = [1e6 * mean(kd, lambda v: v[1][g] / v[0]) for kd in kinds]
    if max(vals) < 0.3: continue
    print(f"  {g:40s} " + "  ".join(f"{x:8.2f}" for x in vals))
allf = {f for v in per.values() for f in v[2]}
diff = []
for f in allf:
    vals = [1e6 * mean(kd, lambda v: v[2].get(f, (0, 0))[0] / v[0]) for kd in kinds]
    nc = [mean(kd, lambda v: v[2].get(f, (0, 0))[1] / v[0]) for kd in kinds]
    diff.append((vals[-1] - vals[0], f, vals, nc))
print("\nfunctions, own us per token (and calls per token) where they differ most:", kinds)
for d, f, vals, nc in sorted(diff, key=lambda x: -abs(x[0]))[:45]:
    print(f"  {d:+7.2f}  {f[:90]:90s} " + "  ".join(f"{v:7.2f} ({c:.2f})" for v, c in zip(vals, nc)))
