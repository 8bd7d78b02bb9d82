import warnings, torch, sys
warnings.filterwarnings("ignore")
import keepkv
from keepkv.eval.tasks import make_passkey
from keepkv.generation import build_prompts, encode
torch.set_num_threads(1)
model, tok = keepkv.load_model()
s = make_passkey(2, 1024, 1000)
texts = build_prompts(tok, [x.prompt for x in s], True, " " + s[0].answer_prefix)
inp = encode(tok, texts[:1], True, "cpu")
variants = sys.argv[1:]
keepkv.enable(model)
for v in variants:
    for b in (0.25, 0.1):
        cache = keepkv.CompressedCache(model.config, v, b)
        with torch.no_grad():
            model(**inp, past_key_values=cache)
        merged = lost = live = 0
        for L in cache.layers:
            votes = L.bias.double().exp()
            live += int((L.bias > float("-inf")).sum()); merged += float(votes.sum()) - int((L.bias > float("-inf")).sum())
            lost += float(L.state["lost_votes"].sum())
        print(f"{v:40s} {b}: live {live} merged-in {merged:.0f} evicted {lost:.0f} merge rate {merged/(merged+lost):.2f}", flush=True)
