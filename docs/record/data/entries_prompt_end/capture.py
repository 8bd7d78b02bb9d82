"""Capture the stores a compressing paged step hands LayerStep.decode, then time and profile the
method's decode on copies. argv: methods (specs), flags --whole (16 req kept whole) --prof --cprof."""
import collections, copy, os, sys, time, statistics, torch
sys.path.insert(0, "/work/main/benchmarks/vllm_cpu")
import paged_layer_step as b
from keepkv.step import LayerStep
b.LAYERS = 30
torch.set_num_threads(int(os.environ.get("T", "1")))
captured = {}
orig = LayerStep.decode
def dec(self, store, stats):
    captured.setdefault(self.method.name, []).append((self, copy.deepcopy(store), copy.deepcopy(stats)))
    return orig(self, store, stats)
LayerStep.decode = dec
methods = sys.argv[1].split(",")
for m in methods:
    g = torch.Generator().manual_seed(0)
    if "--whole" in sys.argv: b.keepkv_steps(m, 16, 1056, 64, 40, torch.float32, g, True)
    else: b.keepkv_steps(m, 1, 2048, 0.1, 40, torch.float32, g, False)
def pick(calls):
    count = collections.Counter(tuple(c[1].keys.shape) for c in calls)
    shape = max(count, key=lambda s: (count[s] * s[0] * s[2]))
    return [c for c in calls if tuple(c[1].keys.shape) == shape][-1]
for name, calls in captured.items():
    step, store, stats = pick(calls)
    print(name, len(calls), "store", tuple(store.keys.shape), "query", tuple(stats.query.shape))
    ts = []
    for i in range(30):
        s = copy.deepcopy(store); st = copy.deepcopy(stats)
        t = time.perf_counter(); orig(step, s, st); ts.append(time.perf_counter() - t)
    print(f"  decode {statistics.median(ts)*1e3:.3f} ms (min {min(ts)*1e3:.3f})")
    if "--prof" in sys.argv:
        from torch.profiler import profile
        s = copy.deepcopy(store); st = copy.deepcopy(stats)
        with profile(record_shapes=True) as p:
            orig(step, s, st)
        print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30, max_shapes_column_width=90))
if "--cprof" in sys.argv:
    import cProfile, pstats
    step, store, stats = pick(captured[list(captured)[-1]])
    copies = [(copy.deepcopy(store), copy.deepcopy(stats)) for _ in range(50)]
    pr = cProfile.Profile(); pr.enable()
    for s, st in copies: orig(step, s, st)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(r"keepkv/", 40)
