"""Counts and paired differences of the learned selection's served variants on the dev grid.

python analyse.py OLD NEW [paired.json]: OLD, the cells of the 48-prompt grid of 2026-11-30
(kvzip, snapkv, the learned selection before its scores were rounded); NEW, this record's cells
(the learned selection with rounded scores, and its trained split cut into 3 and 5 groups)."""
import glob, json, sys

from keepkv.eval.paired import paired_difference

cells = {}
for root, tag in ((sys.argv[1], "old"), (sys.argv[2], "new")):
    for setting in ("aware", "agnostic"):
        for f in glob.glob(f"{root}/{setting}/cells/*.json"):
            d = json.load(open(f))
            suite = d["suite"].replace("+setting=agnostic", "")
            method = d["method"] + (" (before rounding)" if tag == "old" and "learned" in d["method"] else "")
            cells[(setting, suite, method, d["budget"])] = {r["id"]: r["score"] for r in d["records"]}

SUITES = [("needle", "needle"), ("passkey", "pass key"), ("needle+haystack=prose+digits=5", "prose")]
BUDGETS = [0.1, 0.2, 0.25]
L = "snapkv+selection=learned"
METHODS = ["kvzip", "snapkv", f"{L} (before rounding)", L, f"{L}+budget_groups=3", f"{L}+budget_groups=5"]
PAIRS = [(m, ref) for m in (L, f"{L}+budget_groups=3", f"{L}+budget_groups=5") for ref in ("kvzip", "snapkv")] + [
    (f"{L}+budget_groups=5", L), (f"{L}+budget_groups=3", L)]
rows, lines = [], []
for setting in ("aware", "agnostic"):
    lines.append(f"\n### {setting}: found, of 48\n")
    lines.append("| method | " + " | ".join(f"{n} @{b}" for _, n in SUITES for b in BUDGETS) + " |")
    lines.append("| --- |" + " ---: |" * 9)
    for m in METHODS:
        vals = [cells.get((setting, s, m, b)) for s, _ in SUITES for b in BUDGETS]
        lines.append(f"| {m} | " + " | ".join("—" if c is None else str(int(round(sum(c.values())))) for c in vals) + " |")
    for a, ref in PAIRS:
        lines.append(f"\n{setting}: {a} − {ref}: found difference; mean ± 95% half-width; resolved\n")
        cols = []
        for s, name in SUITES:
            for b in BUDGETS:
                ca, cr = cells.get((setting, s, a, b)), cells.get((setting, s, ref, b))
                if ca is None or cr is None:
                    cols.append("—")
                    continue
                ids = sorted(set(ca) & set(cr))
                pd = paired_difference([ca[i] for i in ids], [cr[i] for i in ids])
                diff = int(round(sum(ca[i] for i in ids) - sum(cr[i] for i in ids)))
                rows.append(dict(setting=setting, suite=s, budget=b, method=a, reference=ref, n=pd.n, diff=diff,
                                 mean=pd.mean, ci95=pd.ci95, resolved=pd.resolved))
                cols.append(f"{diff:+d} ({pd.mean:+.2f} ± {pd.ci95:.2f}{', resolved' if pd.resolved else ''})")
        lines.append("| " + " | ".join(f"{n} @{b}" for _, n in SUITES for b in BUDGETS) + " |")
        lines.append("|" + " ---: |" * 9)
        lines.append("| " + " | ".join(cols) + " |")
print("\n".join(lines))
if len(sys.argv) > 3:
    json.dump(rows, open(sys.argv[3], "w"), indent=1)
