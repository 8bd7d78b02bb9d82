import torch, time, math
torch.set_num_threads(1)
def t(f, n=40):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
from keepkv.merging import cosine_nearest
from keepkv.entries import gather_entries
for (B,S,E,K) in [(1,2048,1840,60),(1,2048,1840,205),(14,206,16,206),(48,65,16,65)]:
    H,D=3,64
    k=torch.randn(B,H,S,D)
    src=torch.stack([torch.randperm(S)[:E] for _ in range(B*H)]).view(B,H,E)
    cand=torch.stack([torch.randperm(S)[:K] for _ in range(B*H)]).view(B,H,K)
    mask=torch.zeros(B,H,S,dtype=torch.bool); mask.scatter_(-1,cand,True)
    ref=cosine_nearest(k, src, mask, cand)
    def alt():
        targets = gather_entries(k, cand) if 2*K < S else k
        allowed = mask.gather(-1, cand) if 2*K < S else mask
        tu = targets / targets.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        sk = gather_entries(k, src)
        sim = tu @ sk.transpose(-1, -2)  # [B,H,K,E]
        sim.masked_fill_(~allowed[..., None], -math.inf)
        best, idx = sim.max(dim=-2)
        best.div_(sk.norm(dim=-1).clamp_min(1e-12))
        if 2*K < S: idx = cand.gather(-1, idx)
        return idx, best
    a=alt()
    print(B,S,E,K, "cur", round(t(lambda: cosine_nearest(k, src, mask, cand)),3), "alt", round(t(alt),3),
          "idx eq", torch.equal(a[0], ref[0]), "sim maxdiff", (a[1]-ref[1]).abs().max().item())
print("variant: targets @ src_unit.T, transposed view")
for (B,S,E,K) in [(1,2048,1840,60),(1,2048,1840,205),(14,206,16,206),(48,65,16,65)]:
    H,D=3,64
    k=torch.randn(B,H,S,D)
    src=torch.stack([torch.randperm(S)[:E] for _ in range(B*H)]).view(B,H,E)
    cand=torch.stack([torch.randperm(S)[:K] for _ in range(B*H)]).view(B,H,K)
    mask=torch.zeros(B,H,S,dtype=torch.bool); mask.scatter_(-1,cand,True)
    ref=cosine_nearest(k, src, mask, cand)
    def v2():
        g = 2*K < S
        targets = gather_entries(k, cand) if g else k
        allowed = mask.gather(-1, cand) if g else mask
        tn = targets.norm(dim=-1).clamp_min(1e-12).unsqueeze(-2)
        sk = gather_entries(k, src)
        su = sk / sk.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        sim = (targets @ su.transpose(-1, -2)).transpose(-1, -2).div_(tn)
        sim.masked_fill_(~allowed.unsqueeze(-2), -math.inf)
        best, idx = sim.max(dim=-1)
        if g: idx = cand.gather(-1, idx)
        return idx, best
    a=v2()
    print(B,S,E,K, "cur", round(t(lambda: cosine_nearest(k, src, mask, cand)),3), "v2", round(t(v2),3),
          "idx eq", torch.equal(a[0], ref[0]), "sim maxdiff", (a[1]-ref[1]).abs().max().item())
