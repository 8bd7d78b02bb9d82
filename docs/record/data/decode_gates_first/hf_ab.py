"""A/B: HF decode of keepkv on CPU with static_shapes True (static path) vs None (gates first)."""
import time, statistics, sys, torch, keepkv
from keepkv.eval.datasets import *  # noqa
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
model, tok = keepkv.load_model()
keepkv.enable(model)
import pydoc_data.topics as t
text = " ".join(list(t.topics.values())[:40])
ids = tok(text, return_tensors="pt").input_ids[:, :512].repeat(4, 1)
mask = torch.ones_like(ids)
res = {}
for rnd in range(3):
    for static in (True, None):
        cache = keepkv.CompressedCache(model.config, "keepkv", 0.1, static_shapes=static)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
            tok_ = out.logits[:, -1:].argmax(-1); m = mask
            for _ in range(8):
                m = torch.cat([m, torch.ones_like(tok_)], -1)
                out = model(input_ids=tok_, attention_mask=m, past_key_values=cache); tok_ = out.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(48):
                m = torch.cat([m, torch.ones_like(tok_)], -1)
                out = model(input_ids=tok_, attention_mask=m, past_key_values=cache); tok_ = out.logits[:, -1:].argmax(-1)
            res.setdefault(static, []).append((time.perf_counter() - t0) / 48 * 1e3)
for k, v in res.items():
    print("static" if k else "gates-first", [round(x, 2) for x in v], "ms/step")
