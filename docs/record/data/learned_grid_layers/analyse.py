"""Counts and paired differences of learned+budgets=layers on the dev grid, against the earlier
run's per-prompt results (../learned_grid/per_prompt_scores.json: same seed 1001, 32 prompts).
Adapted from ../learned_grid/analyse.py (same paired_difference, same table layout).

usage: PYTHONPATH=<keepkv src> python analyse.py <new grid root with {aware,agnostic}/cells> [paired.json] [per_prompt_scores.json]
"""
import glob, json, os, sys
from keepkv.eval.paired import paired_difference

here = os.path.dirname(os.path.abspath(__file__))
old = json.load(open(os.path.join(here, "..", "learned_grid", "per_prompt_scores.json")))
root = sys.argv[1]
cells = {}   # (setting, suite, method, budget) -> {index: score}
for setting in ("aware", "agnostic"):
    for suite, d in old[setting].items():
        for key, bits in d.items():
            m, b = key.rsplit("@", 1)
            cells[(setting, suite.replace("+setting=agnostic", ""), m, float(b))] = {i: float(c) for i, c in enumerate(bits)}
new = {"aware": {}, "agnostic": {}, "_note": "per-prompt scores (1 found, 0 not), prompts in sample-id order 0..31 of seed 1001, from grid/*/cells/*.json"}
fullcheck = []
for setting in ("aware", "agnostic"):
    for f in glob.glob(f"{root}/{setting}/cells/*.json"):
        d = json.load(open(f))
        suite = d["suite"].replace("+setting=agnostic", "")
        sc = {int(r["id"].rsplit("-", 1)[1]): r["score"] for r in d["records"]}
        k = (setting, suite, d["method"], d["budget"])
        if k in cells:   # full: rerun here; must match the earlier run prompt for prompt
            fullcheck.append((k, cells[k] == sc))
        cells[k] = sc
        new[setting].setdefault(suite, {})[f"{d['method']}@{d['budget']}"] = "".join(str(int(round(sc[i]))) for i in sorted(sc))

SUITES = [("needle", "needle"), ("passkey", "pass key"), ("needle+haystack=prose+digits=5", "prose needle")]
BUDGETS = [0.1, 0.2, 0.25]
LL, KL, L = "snapkv+selection=learned+budgets=layers", "keepkv+selection=learned+budgets=layers", "snapkv+selection=learned"
METHODS = ["full", "kvzip", "snapkv", L, "keepkv+selection=learned", LL, KL]
PAIRS = [(LL, "kvzip"), (LL, "snapkv"), (KL, LL), (KL, "kvzip"), (LL, L)]

def get(setting, suite, method, b):
    return cells.get((setting, suite, method, 1.0 if method == "full" else b))

lines = [f"full rerun matches the earlier run prompt for prompt: {sum(ok for _, ok in fullcheck)} of {len(fullcheck)} cells"]
rows = []
for setting in ("aware", "agnostic"):
    if not glob.glob(f"{root}/{setting}/cells/*.json"):
        lines.append(f"\n### {setting}: not run\n"); continue
    title = "question inside the prompt (aware)" if setting == "aware" else "context compressed before the question (agnostic)"
    lines.append(f"\n### Found of 32, {title}\n")
    lines.append("| method | " + " | ".join(f"{n} @{b}" for _, n in SUITES for b in BUDGETS) + " |")
    lines.append("| --- |" + " ---: |" * 9)
    for m in METHODS:
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
if len(sys.argv) > 2:
    json.dump(rows, open(sys.argv[2], "w"), indent=1)
if len(sys.argv) > 3:
    json.dump(new, open(sys.argv[3], "w"), indent=1)

# The three targets, per setting, from the paired rows above.
NAME = {s: n for s, n in SUITES}
def cellname(r):
    return f"{NAME[r['suite']]} @{r['budget']}"
def pick(setting, a, ref):
    return [r for r in rows if r["setting"] == setting and r["method"] == a and r["reference"] == ref]
out = ["\n### Targets (per setting; cells that fail, with count difference, * = resolved)\n",
       "| setting | 1. LL within 2 of kvzip (d ≥ −2) or t interval includes 0 | 1'. share reading (d ≥ −1) or interval includes 0 | 2. LL ≥ snapkv | 3. KL ≥ LL |",
       "| --- | --- | --- | --- | --- |"]
for setting in ("aware", "agnostic"):
    t1, t2, t3 = pick(setting, LL, "kvzip"), pick(setting, LL, "snapkv"), pick(setting, KL, LL)
    if not t1:
        continue
    def fmt(rs, ok):
        bad = [r for r in rs if not ok(r)]
        return f"{len(rs) - len(bad)} of {len(rs)} hold" + ("; fails: " + ", ".join(f"{cellname(r)} {r['diff']:+d}{'*' if r['resolved'] else ''}" for r in bad) if bad else "")
    out.append(f"| {setting} | {fmt(t1, lambda r: r['diff'] >= -2 or r['ci_includes_0'])} | "
               f"{fmt(t1, lambda r: r['diff'] >= -1 or r['ci_includes_0'])} | "
               f"{fmt(t2, lambda r: r['diff'] >= 0)} | {fmt(t3, lambda r: r['diff'] >= 0)} |")
print("\n".join(out))
