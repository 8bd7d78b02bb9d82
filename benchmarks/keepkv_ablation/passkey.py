"""Dev harness: pass-key docs (keepkv.demo.document, seeds 101..), one shared prefill per doc,
every method forked and decoded. Usage: python benchmarks/keepkv_ablation/passkey.py N_DOCS BUDGET METHOD..."""
import sys
import torch
import keepkv
from keepkv.attention import Needs, enabled
from keepkv.cache import CompressedCache
from keepkv.demo import ANSWER_PREFIX, QUESTION, document
from keepkv.eval.decoding import decode_cells, prefill
from keepkv.generation import build_prompts, encode
from keepkv.methods import get_method

n, budget, methods = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
torch.set_num_threads(2)
model, tok = keepkv.load_model()
right = {m: 0 for m in methods}
with torch.inference_mode():
    for seed in range(101, 101 + n):
        doc, key = document(1000, depth=0.2 + 0.6 * ((seed * 7) % 10) / 10, seed=seed)
        texts = build_prompts(tok, [f"{doc}\n\n{QUESTION}"], True, " " + ANSWER_PREFIX)
        inputs = encode(tok, texts, True, "cpu")
        inst = [get_method(m) for m in methods]
        with enabled(model):
            record = CompressedCache(model.config, "full", record=Needs.union([m.needs(True) for m in inst]))
            first = prefill(model, record, inputs["input_ids"], inputs["attention_mask"])
            caches = [record.fork(m, budget) for m in inst]
            outs = decode_cells(model, caches, first, inputs["attention_mask"], 7, tok.eos_token_id, progress=False)
        answers = [tok.decode(o[0], skip_special_tokens=True).strip() for o in outs]
        for m, a in zip(methods, answers):
            right[m] += key in a
        print(seed, key, " | ".join(f"{m}:{a!r}" for m, a in zip(methods, answers)), flush=True)
for m in methods:
    print(f"{m:<55} {right[m]}/{n}")
