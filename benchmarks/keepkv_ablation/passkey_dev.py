"""Dev-seed pass-key documents (Python docs prose, which has numbers of its own, with a 5-digit key):
does ZIP-merging corrupt the key? Run from the repository root: python benchmarks/keepkv_ablation/passkey_dev.py
"""
import warnings

import torch

import keepkv
from keepkv.demo import ANSWER_PREFIX, QUESTION, document

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
model, tok = keepkv.load_model()
seeds = range(1000, 1016)
docs = [document(target_tokens=700, depth=d, seed=s) for s, d in zip(seeds, [0.2, 0.4, 0.6, 0.8] * 4)]
prompts = [f"{text}\n\n{QUESTION}" for text, _ in docs]
for method in ["full", "snapkv", "keepkv", "keepkv+threshold=0.9", "keepkv+threshold=0.95", "snapkv+merge=zip+zip_key=group"]:
    for budget in ([1.0] if method == "full" else [0.5, 0.25, 0.1]):
        rs = keepkv.generate(model, tok, prompts, method=method, budget=budget, max_new_tokens=7, answer_prefix=" " + ANSWER_PREFIX, progress=False)
        hits = sum(key in r.answer for (_, key), r in zip(docs, rs))
        print(f"{method:32s} {budget:>5}: {hits}/{len(docs)}", flush=True)
