import json, glob, sys, collections, math
for setting in ("aware", "agnostic"):
    cells = {}
    for p in glob.glob(f"/tmp/s7/grid_{setting}/cells/**/*.json", recursive=True):
        d = json.load(open(p))
        m = "cand" if "scorer=" in d["method"] else d["method"]
        cells[(d["suite"], m, d["budget"])] = [r["score"] for r in d["records"]]
    print(f"== {setting}")
    tot = collections.Counter()
    for (suite, m, b) in sorted(k for k in cells if k[1] == "snapkv+selection=learned"):
        a, c = cells[(suite, m, b)], cells[(suite, "cand", b)]
        da = sum(a); dc = sum(c)
        diff = [y - x for x, y in zip(a, c)]
        mean = sum(diff) / len(diff); sd = (sum((d - mean) ** 2 for d in diff) / (len(diff) - 1)) ** .5
        up = sum(1 for d in diff if d > 0); down = sum(1 for d in diff if d < 0)
        print(f"{suite:45s} {b:5} shipped {da:5.1f} cand {dc:5.1f}  diff {mean:+.3f} ± {2.04*sd/math.sqrt(len(diff)):.3f} (+{up}/-{down})")
        tot["shipped"] += da; tot["cand"] += dc
    print(dict(tot))
