"""Per-process utime/stime deltas over 20 s while a probe's load runs (py-spy present)."""
import os, subprocess, sys, time
def snap():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit(): continue
        try:
            s = open(f"/proc/{pid}/stat").read()
            comm = s[s.index("(")+1:s.rindex(")")]
            f = s[s.rindex(")")+2:].split()
            out[int(pid)] = (comm, int(f[11]), int(f[12]))
        except Exception: pass
    return out
n = 0
while n < int(sys.argv[1]):
    while subprocess.run(["pgrep", "py-spy"], capture_output=True).returncode != 0: time.sleep(1)
    time.sleep(5)
    a = snap(); t = time.time(); time.sleep(20); b = snap(); dt = time.time() - t
    rows = [(b[p][2]-a[p][2], b[p][1]-a[p][1], p, b[p][0]) for p in b if p in a]
    rows.sort(reverse=True)
    kind = open("/tmp/probe-four.log").read().count("\nround ") + open("/tmp/probe-four.log").read().startswith("round ")
    print(f"--- load #{kind} at {time.strftime('%H:%M:%S')}: total stime {sum(r[0] for r in rows)/100/dt:.3f} cores, utime {sum(r[1] for r in rows)/100/dt:.3f}")
    for st, ut, p, c in rows[:12]:
        print(f"  {c:20s} {p:7d} stime {st/100/dt:.3f} utime {ut/100/dt:.3f}")
    sys.stdout.flush()
    while subprocess.run(["pgrep", "py-spy"], capture_output=True).returncode == 0: time.sleep(1)
    n += 1
