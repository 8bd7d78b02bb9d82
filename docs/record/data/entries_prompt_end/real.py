import sys, time, json, inspect, torch
import keepkv
from keepkv.methods import keepkv as kk
torch.set_num_threads(2)
model, tok = keepkv.load_model()
src = inspect.getsource(json.decoder)[:9000]
prompts = [src + "\n\nQuestion: what does this module do? Answer briefly.", inspect.getsource(json.encoder)[:8000] + "\n\nSummarise the code above."]
counts = []
orig = kk.KeepKVMerge.worth_merging
def wm(self, layer, plan, pooled, merge):
    out = orig(self, layer, plan, pooled, merge)
    if plan.evict_idx.shape[-1] > 50:
        counts.append((int(out.sum()), int(plan.evict_valid.sum())))
    return out
kk.KeepKVMerge.worth_merging = wm
res = keepkv.generate(model, tok, prompts, "keepkv", 0.1, max_new_tokens=48)
print(json.dumps([r.answer for r in res])[:300])
with open(sys.argv[1], "w") as f: json.dump([r.answer for r in res], f)
tot = [sum(c[i] for c in counts) for i in (0, 1)]
print("calls", len(counts), "eligible/evicted", tot, round(tot[0] / max(1, tot[1]), 3))
