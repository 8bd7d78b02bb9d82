"""Fit scorers of several kinds and feature sets on the collected KVzip targets (/tmp/kvz/doc*.pt,
written by /tmp/collect.py = keepkv.scorer_training.kvzip_scores on default_corpus(50, 4000, 0))."""
import glob, json, math, random, sys, time
import torch
import keepkv
from keepkv.scorer import ScorerData, config_key, prior_scores, spearman, kept_overlap, log_targets
torch.set_num_threads(2)
m, tok = keepkv.load_model()
key = config_key(m)
del m
paths = sorted(glob.glob("/tmp/kvz/doc*.pt"))
docs = [torch.load(p) for p in paths]
n = len(docs)
order = list(range(n)); random.Random(0).shuffle(order)
held = set(order[: math.ceil(0.1 * n)])
print("documents", n, "held out", sorted(held), "tokens", sum(d["positions"].numel() for d in docs),
      "kvzip target seconds", round(sum(d["seconds"] for d in docs), 1), flush=True)
results = {}
# the untrained prior (-log ||k||)
rho, o1, o2 = [], [], []
for i in held:
    d = docs[i]; keep = d["positions"] >= 4
    pred = prior_scores(d["keys"][:, :, keep]); y = log_targets(d["scores"][:, :, keep])
    rho.append(spearman(pred, y).mean()); o1.append(kept_overlap(pred, y, 0.1).mean()); o2.append(kept_overlap(pred, y, 0.2).mean())
results["prior -log||k||"] = {"spearman": float(torch.stack(rho).mean()), "overlap@0.1": float(torch.stack(o1).mean()), "overlap@0.2": float(torch.stack(o2).mean())}
print("prior", results["prior -log||k||"], flush=True)
configs = [(f, "linear", {}) for f in ("values+pairs", "pairs", "values", "keys+values")]
configs += [("values+pairs", "mlp", {"hidden": 32}), ("values+pairs", "mlp", {"hidden": 64})]
configs += [("unrotated+values", "linear", {}), ("unrotated+values", "mlp", {"hidden": 32})]
if len(sys.argv) > 1:
    configs = [c for c in configs if c[0] + ":" + c[1] + str(c[2].get("hidden", "")) in sys.argv[1:]]
for feats, kind, options in configs:
    start = time.perf_counter()
    data = ScorerData(key["layers"], key["kv_heads"], key["head_dim"], feats, 256, 4, 0, key)
    for i, d in enumerate(docs):
        data.add(d["keys"].float(), d["values"].float(), d["scores"], d["positions"], held_out=i in held)
    gathered = time.perf_counter()
    scorer = data.fit(kind, **options)
    fitted = time.perf_counter()
    figures = data.evaluate(scorer)
    name = f"{feats}:{kind}{options.get('hidden', '')}"
    figures.update(seconds_gather=round(gathered - start, 1), seconds_fit=round(fitted - gathered, 1))
    results[name] = figures
    print(name, json.dumps(figures), flush=True)
    if feats in ("values+pairs", "unrotated+values"):
        scorer.report.update(figures, kind=kind, features=feats, documents=n, corpus="default_corpus(50, 4000, seed=0)")
        scorer.save(f"/tmp/kvzwork/{feats}-{kind}{options.get('hidden', '')}.pt")
json.dump(results, open("/tmp/kvzwork/results-" + "-".join(sys.argv[1:]) + ".json", "w"), indent=1)
