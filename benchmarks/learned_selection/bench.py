"""Prefill cost and kept-set overlap with KVzip on held-out documents of the default corpus (embedded model).
python /tmp/bench.py LINEAR.pt MLP.pt"""
import math, random, sys, time, json, warnings
import torch, keepkv
from keepkv.scorer_training import default_corpus
torch.set_num_threads(2)
warnings.simplefilter("ignore")
m, tok = keepkv.load_model()
texts = default_corpus(50, 4000, 0)
order = list(range(50)); random.Random(0).shuffle(order)
held = sorted(order[:5])
linear, mlp = sys.argv[1], sys.argv[2]
methods = {"full": ("full", {}), "snapkv": ("snapkv", {}), "keydiff": ("keydiff", {}),
           "kvzip+budgets=uniform": ("kvzip+budgets=uniform", {}), "kvzip": ("kvzip", {}),
           "learned linear": ("snapkv+selection=learned", {"scorer": linear}),
           "learned mlp32": ("snapkv+selection=learned", {"scorer": mlp})}
budget = float(sys.argv[3]) if len(sys.argv) > 3 else 0.2
times = {k: [] for k in methods}; overlap = {k: [] for k in methods}
keepkv.compress(m, tok, texts[held[0]][:500], method="snapkv+selection=learned", budget=0.5, scorer=linear)  # warm
for i in held:
    kept = {}
    for name, (spec, params) in methods.items():
        b = 1.0 if name == "full" else budget
        start = time.perf_counter()
        cache = keepkv.compress(m, tok, texts[i], method=spec, budget=b, **params)
        times[name].append(time.perf_counter() - start)
        kept[name] = [l.positions[0].masked_fill(~l.live()[0], -1) for l in cache.layers]  # [H, S']
    ref = kept["kvzip+budgets=uniform"]
    for name in methods:
        shares = []
        for mine, theirs in zip(kept[name], ref):
            size = max(int(mine.max()), int(theirs.max())) + 1
            a = torch.zeros(mine.shape[0], size + 1, dtype=torch.bool).scatter_(1, mine.clamp(min=-1) + 1, True)[:, 5:]
            b_ = torch.zeros(theirs.shape[0], size + 1, dtype=torch.bool).scatter_(1, theirs + 1, True)[:, 5:]
            shares.append(((a & b_).sum(-1).double() / b_.sum(-1).clamp(min=1)).mean())
        overlap[name].append(float(torch.stack(shares).mean()))
    print(i, {k: round(v[-1], 2) for k, v in times.items()}, {k: round(v[-1], 3) for k, v in overlap.items()}, flush=True)
print(json.dumps({"budget": budget, "seconds_median": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
                  "overlap_with_kvzip_uniform": {k: sum(v) / len(v) for k, v in overlap.items()}}, indent=1))
