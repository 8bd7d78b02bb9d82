"""Measure the shipped scorer's layer shares on documents of the training corpus and write them into the file."""
import sys, torch, keepkv
from keepkv.scorer import default_scorer, load_scorer
from keepkv.scorer_training import default_corpus, kvzip_scores, layer_shares, SHARE_DOCUMENTS
from keepkv.generation import context_and_question_ids
model, tok = keepkv.load_model()
scorer = load_scorer(default_scorer())
texts = default_corpus()  # the corpus it was trained on (50 documents, seed 0)
docs = []
for text in texts[:SHARE_DOCUMENTS]:
    ids, _ = context_and_question_ids(tok, text, "", True)
    cache = keepkv.CompressedCache(model.config, "full", 1.0)
    with torch.no_grad():
        keepkv.enable(model)
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    keys = torch.stack([l.keys[0] for l in cache.layers]); values = torch.stack([l.values[0] for l in cache.layers])
    docs.append((keys, values, cache.layers[0].positions[0, 0]))
    print(len(ids), flush=True)
shares = layer_shares(scorer, docs)
for b, row in zip(shares["budgets"], shares["shares"]):
    print(b, [round(x, 2) for x in row])
scorer.layer_shares = shares
if len(sys.argv) > 1:
    scorer.save(sys.argv[1]); print("saved", sys.argv[1])
