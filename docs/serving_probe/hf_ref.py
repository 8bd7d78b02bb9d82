import time, json, torch, keepkv
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
m, t = keepkv.load_model()
m.eval()
for p in PROMPTS:
    ids = t(p, return_tensors="pt")
    t0 = time.time()
    with torch.no_grad():
        out = m.generate(**ids, do_sample=False, max_new_tokens=16)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    print("HF", json.dumps(p), ids["input_ids"][0].tolist(), "->", json.dumps(t.decode(new)), new, f"{time.time()-t0:.2f}s")
