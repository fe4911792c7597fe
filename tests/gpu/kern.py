"""A torch.profiler chrome trace, summarised per recorded step: on a GPU the kernels (count, busy
ms, the top ones by time); on CPU the aten ops whose largest input has >= 1M elements (when the
trace recorded shapes). usage: python3 kern.py TRACE STEPS [TOP]"""
import collections
import json
import math
import sys

trace, steps = json.load(open(sys.argv[1])), int(sys.argv[2])
top = int(sys.argv[3]) if len(sys.argv) > 3 else 30
events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
totals = collections.defaultdict(lambda: [0, 0.0])  # name -> [count, microseconds]
if kernels:
    for e in kernels:
        totals[e["name"][:90]][0] += 1
        totals[e["name"][:90]][1] += e["dur"]
    busy = sum(e["dur"] for e in kernels) / steps / 1000
    print(f"{len(kernels) / steps:.0f} kernels/step, busy {busy:.2f} ms/step")
else:
    for e in events:
        if e.get("cat") != "cpu_op" or not e["name"].startswith("aten::"):
            continue
        dims = [d for d in e.get("args", {}).get("Input Dims", []) if isinstance(d, list) and d]
        big = max([math.prod(d) for d in dims if all(isinstance(x, int) for x in d)], default=0)
        if big >= 1_000_000:
            totals[f"{e['name']} {big:,}"][0] += 1
            totals[f"{e['name']} {big:,}"][1] += e["dur"]
for name, (count, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]:
    print(f"{us / steps / 1000:8.3f} ms  x{count / steps:5.1f}  {name}")
