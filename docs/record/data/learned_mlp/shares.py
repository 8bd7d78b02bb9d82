import sys, torch, keepkv
from keepkv.scorer import load_scorer
from keepkv.scorer_training import default_corpus, kvzip_scores, layer_shares
torch.set_num_threads(1)
model, tokenizer = keepkv.load_model()
scorer = load_scorer(sys.argv[1], model)
docs = []
for text in default_corpus(8, 4000, 0):
    k, v, s, p = kvzip_scores(model, tokenizer, text)
    docs.append((k, v, p))
scorer.layer_shares = layer_shares(scorer, docs)
scorer.save(sys.argv[2])
print(scorer.layer_shares["shares"][1])
