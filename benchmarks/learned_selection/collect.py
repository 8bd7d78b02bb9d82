import time, torch, keepkv, sys
from keepkv.scorer_training import kvzip_scores, default_corpus
torch.set_num_threads(2)
m, tok = keepkv.load_model()
texts = default_corpus(50, 4000, 0)
t0 = time.time()
for i, t in enumerate(texts):
    s = time.time()
    k, v, sc, p = kvzip_scores(m, tok, t)
    torch.save({"keys": k.half(), "values": v.half(), "scores": sc, "positions": p, "seconds": time.time() - s}, f"/tmp/kvz/doc{i:02d}.pt")
    print(i, k.shape[2], round(time.time() - s, 1), round(time.time() - t0, 1), flush=True)
