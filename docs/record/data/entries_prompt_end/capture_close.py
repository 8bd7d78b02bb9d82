import copy, sys, time, statistics, torch
sys.path.insert(0, "/work/main/benchmarks/vllm_cpu")
import paged_layer_step as b
from keepkv.paged import PagedCompression
b.LAYERS = 2
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 1)
captured = {}
orig = PagedCompression._end_prompt
def endp(self, slots, plan, rows, store, stats, sizes, layer, everything=False, first=0):
    budgets = plan.budgets(rows, layer, store.device)
    captured.setdefault(self.method.name, []).append((self.step, copy.deepcopy(store), copy.deepcopy(stats), budgets, plan.interval(rows)))
    return orig(self, slots, plan, rows, store, stats, sizes, layer, everything, first)
PagedCompression._end_prompt = endp
methods = sys.argv[1].split(",")
for m in methods:
    g = torch.Generator().manual_seed(0)
    b.keepkv_steps(m, 1, 2048, 0.1, 2, torch.float32, g, False)
def run(step, store, stats, budgets, interval):
    step.observe_prompt(store, stats)
    t = time.perf_counter()
    step.close_prompt(store, *budgets, stats, interval)
    return t
for name, calls in captured.items():
    step, store, stats, budgets, interval = calls[-1]
    print(name, len(calls), store.keys.shape, None if stats.logits is None else stats.logits.shape, stats.query.shape)
    obs, clo = [], []
    for i in range(20):
        s = copy.deepcopy(store); st = copy.deepcopy(stats)
        t0 = time.perf_counter(); t1 = run(step, s, st, budgets, interval); t2 = time.perf_counter()
        obs.append(t1 - t0); clo.append(t2 - t1)
    print(f"  observe {statistics.median(obs)*1e3:.3f} ms  close {statistics.median(clo)*1e3:.3f} ms")
if "--cprof" in sys.argv:
    import cProfile, pstats
    step, store, stats, budgets, interval = captured[methods[-1]][-1]
    copies = [(copy.deepcopy(store), copy.deepcopy(stats)) for _ in range(20)]
    pr = cProfile.Profile(); pr.enable()
    for s, st in copies: run(step, s, st, budgets, interval)
    pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(r"keepkv/", 45)
if "--tprof" in sys.argv:
    from torch.profiler import profile, record_function
    step, store, stats, budgets, interval = captured[methods[-1]][-1]
    for i in range(3): run(step, copy.deepcopy(store), copy.deepcopy(stats), budgets, interval)
    s, st = copy.deepcopy(store), copy.deepcopy(stats)
    with profile() as p:
        with record_function("observe"):
            step.observe_prompt(s, st)
        with record_function("close"):
            step.close_prompt(s, *budgets, st, interval)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
