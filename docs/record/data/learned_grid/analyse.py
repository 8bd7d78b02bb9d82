"""Per-cell counts and paired differences of the learned dev grid, from the eval's cells/."""
import glob, json, sys
sys.path.insert(0, "/tmp/grid59/src")
from keepkv.eval.paired import paired_difference

root = sys.argv[1]
out = {}
cells = {}
for setting in ("aware", "agnostic"):
    for f in glob.glob(f"{root}/{setting}/cells/*.json"):
        d = json.load(open(f))
        suite = d["suite"].replace("+setting=agnostic", "")
        cells[(setting, suite, d["method"], d["budget"])] = {r["id"]: r["score"] for r in d["records"]}

SUITES = [("needle", "needle"), ("passkey", "pass key"), ("needle+haystack=prose+digits=5", "prose needle")]
BUDGETS = [0.1, 0.2, 0.25]
METHODS = {"aware": ["full", "snapkv", "kvzip", "snapkv+selection=learned", "keepkv+selection=learned"],
           "agnostic": ["full", "kvzip", "keepkv+selection=kvzip", "snapkv", "snapkv+selection=learned", "keepkv+selection=learned"]}
L, K = "snapkv+selection=learned", "keepkv+selection=learned"
PAIRS = [(L, "kvzip"), (L, "snapkv"), (K, L), (K, "kvzip")]

def get(setting, suite, method, b):
    return cells.get((setting, suite, method, 1.0 if method == "full" else b))

lines = []
rows = []
for setting in ("aware", "agnostic"):
    title = "question inside the prompt (aware)" if setting == "aware" else "context compressed before the question (agnostic)"
    ns = {len(c) for k, c in cells.items() if k[0] == setting}
    lines.append(f"\n### Found, {title}; n = {sorted(ns)}\n")
    head = "| method | " + " | ".join(f"{n} @{b}" for _, n in SUITES for b in BUDGETS) + " |"
    lines.append(head)
    lines.append("| --- |" + " ---: |" * 9)
    for m in METHODS[setting]:
        vals = []
        for s, _ in SUITES:
            for b in BUDGETS:
                c = get(setting, s, m, b)
                vals.append("—" if c is None else f"{int(round(sum(c.values())))}")
        lines.append(f"| {m} | " + " | ".join(vals) + " |")
    for a, ref in PAIRS:
        lines.append(f"\n{setting}: {a} − {ref} (found difference of n; mean ± 95% half-width; wins/losses; McNemar p)\n")
        lines.append("| cell | count diff | mean ± ci95 | wins / losses | p | resolved |")
        lines.append("| --- | ---: | --- | --- | ---: | --- |")
        for s, name in SUITES:
            for b in BUDGETS:
                ca, cr = get(setting, s, a, b), get(setting, s, ref, b)
                if ca is None or cr is None:
                    continue
                ids = sorted(set(ca) & set(cr))
                pd = paired_difference([ca[i] for i in ids], [cr[i] for i in ids])
                cd = int(round(sum(ca[i] for i in ids) - sum(cr[i] for i in ids)))
                rows.append(dict(setting=setting, suite=s, budget=b, method=a, reference=ref, n=pd.n,
                                 found=int(round(sum(ca[i] for i in ids))), found_ref=int(round(sum(cr[i] for i in ids))),
                                 diff=cd, mean=pd.mean, ci95=pd.ci95, wins=pd.wins, losses=pd.losses,
                                 p=pd.mcnemar_p, resolved=pd.resolved, ci_includes_0=abs(pd.mean) <= pd.ci95))
                lines.append(f"| {name} @{b} | {cd:+d} | {pd.mean:+.3f} ± {pd.ci95:.3f} | {pd.wins} / {pd.losses} | {pd.mcnemar_p:.3g} | {'yes' if pd.resolved else 'no'} |")
print("\n".join(lines))
json.dump(rows, open(sys.argv[2], "w"), indent=1) if len(sys.argv) > 2 else None
