import torch, time
torch.set_num_threads(1)
def t(f, n=300):
    f(); s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e6
B,H,C,S,E,D=48,3,81,65,16,64
buf=torch.randn(B,H,C,D); x=buf.narrow(2,0,S)
idx=torch.stack([torch.randperm(S)[:E] for _ in range(B*H)]).view(B,H,E)
rows=torch.randn(B,H,E,D)
bi=torch.arange(B)[:,None,None]; hi=torch.arange(H)[:,None]
print("scatter_", t(lambda: x.scatter_(2, idx[...,None].expand(B,H,E,D), rows)))
print("index_put_", t(lambda: x.__setitem__((bi,hi,idx), rows)))
print("index_put_ tuple", t(lambda: x.index_put_((bi,hi,idx), rows)))
def rowview(x):
    Bx,Hx,Sx=x.shape[:3]; Dx=x.shape[3]
    s0,s1,s2,s3=x.stride()
    assert s3==1 and s2==Dx and s1%Dx==0 and s0%Dx==0
    n=(Bx-1)*s0//Dx+(Hx-1)*s1//Dx+Sx
    flat=x.as_strided((n,Dx),(Dx,1))
    off=(torch.arange(Bx)*(s0//Dx))[:,None,None]+(torch.arange(Hx)*(s1//Dx))[:,None]
    return flat, off
def ic():
    flat, off = rowview(x)
    flat.index_copy_(0, (off+idx).view(-1), rows.view(-1,D))
print("rowview index_copy_", t(ic))
def gsel():
    flat, off = rowview(x)
    return flat.index_select(0, (off+idx).view(-1)).view(B,H,E,D)
print("rowview index_select", t(gsel))
print("gather", t(lambda: x.gather(2, idx[...,None].expand(B,H,E,D))))
print("adv index", t(lambda: x[bi,hi,idx]))
own=torch.randn(B,H,E,D); eg=torch.randint(0,E,(B,H,E))
print("scatter_add", t(lambda: own.scatter_add(-2, eg[...,None].expand(B,H,E,D), rows)))
def ia():
    o=own.clone(); 
    o.view(-1,D).index_add_(0, (torch.arange(B*H).view(B,H,1)*E+eg).view(-1), rows.reshape(-1,D)); return o
print("index_add clone", t(ia))
assert torch.allclose(ia(), own.scatter_add(-2, eg[...,None].expand(B,H,E,D), rows))
g=torch.randn(B,H,3,16,S)
print("sum3 mean2", t(lambda: g.sum(3).mean(2)))
print("flat sum /3", t(lambda: g.flatten(2,3).sum(2)/3))
print("sum3 sum2 /3", t(lambda: g.sum(3).sum(2).div_(3)))
w=torch.randn(16,1); vis=torch.rand(B,H,16,S)>0.1
print("masked_fill bcast", t(lambda: w.masked_fill(~vis, float('-inf'))))
print("where", t(lambda: torch.where(vis, w, float('-inf'))))
