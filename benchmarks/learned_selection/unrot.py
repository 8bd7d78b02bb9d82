import glob, math, random, json, torch
from keepkv.scorer import ScorerData
torch.set_num_threads(2)
docs = [torch.load(p) for p in sorted(glob.glob("/tmp/kvz/doc*.pt"))]
order = list(range(50)); random.Random(0).shuffle(order); held = set(order[:5])
D, theta = 64, 100000.0
inv = theta ** (-torch.arange(0, D, 2).float() / D)  # [D/2]
def unrotate(k, pos):
    ang = pos.float()[:, None] * inv[None]  # [S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([k[..., D // 2:], -k[..., : D // 2]], -1)  # rotate_half inverse: R(-a)k = k cos - rotate_half(k) sin
    return k * cos - torch.cat([-k[..., D // 2:], k[..., : D // 2]], -1) * sin
for kind in ("keys+values", "pairs"):
    data = ScorerData(30, 3, 64, kind, 256, 4, 0)
    for i, d in enumerate(docs):
        k = unrotate(d["keys"].float(), d["positions"])
        data.add(k, d["values"].float(), d["scores"], d["positions"], held_out=i in held)
    s = data.fit("linear")
    print("unrotated keys:", kind, json.dumps(data.evaluate(s)), flush=True)
# sanity: pair norms of unrotated == rotated
d = docs[0]; from keepkv.scorer import features
print(float((features(unrotate(d["keys"].float(), d["positions"]), d["values"].float(), "pairs") - features(d["keys"].float(), d["values"].float(), "pairs")).abs().max()))
