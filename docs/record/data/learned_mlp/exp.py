"""Held-out fit of scorer variants trained on more documents (dev experiment, issue 59)."""
import json, sys, time, torch
import keepkv
from keepkv.scorer import ScorerData, load_scorer, config_key
from keepkv.scorer_training import default_corpus, kvzip_scores
from tqdm import tqdm

N = int(sys.argv[1]); HELD = 20
torch.set_num_threads(1)
model, tokenizer = keepkv.load_model()
key = config_key(model)
texts = default_corpus(N + HELD, 4000, 0)
held = set(range(N, N + HELD))  # never in the shipped scorer's 50 nor in the N training docs
datas = {f: ScorerData(key["layers"], key["kv_heads"], key["head_dim"], f, 256, 4, 0, key) for f in ("values+pairs", "unrotated+values")}
t = time.perf_counter()
for i, text in enumerate(tqdm(texts, mininterval=30)):
    if not text.strip():
        continue
    k, v, s, p = kvzip_scores(model, tokenizer, text)
    for d in datas.values():
        d.add(k, v, s, p, held_out=i in held)
print("gather s", round(time.perf_counter() - t, 1), flush=True)
out = {}
shipped = load_scorer("keepkv/scorers/smollm2-135m-instruct.pt", model)
out["shipped"] = {k: round(v, 4) for k, v in datas["values+pairs"].evaluate(shipped).items() if isinstance(v, float)}
print("shipped", out["shipped"], flush=True)
for f, d in datas.items():
    for kind, hidden, epochs in (("linear", 32, 30), ("mlp", 32, 30), ("mlp", 128, 60)):
        t = time.perf_counter()
        sc = d.fit(kind, 1e-3, hidden, epochs, seed=0, progress=False)
        r = d.evaluate(sc)
        out[f"{f} {kind} {hidden}"] = {**{k: round(v, 4) for k, v in r.items() if isinstance(v, float)}, "fit_s": round(time.perf_counter() - t, 1)}
        print(f, kind, hidden, out[f"{f} {kind} {hidden}"], flush=True)
        sc.save(f"/tmp/s7/scorer/sc_{N}_{f.replace('+','_')}_{kind}_{hidden}.pt")
json.dump(out, open(f"/tmp/s7/scorer/fit_{N}.json", "w"), indent=1)
