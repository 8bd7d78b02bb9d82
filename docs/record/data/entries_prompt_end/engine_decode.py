"""In the engine: each LayerStep.decode call's time, and every 10th call re-run on a copy right after (hot)."""
import copy, json, sys, time, statistics
import keepkv.vllm.bench as bench
from keepkv.step import LayerStep
import torch
orig = LayerStep.decode
REC = []
def dec(self, store, stats):
    snap = copy.deepcopy((store, stats)) if len(REC) % 10 == 0 else None
    snap2 = copy.deepcopy((store, stats)) if len(REC) == 100 else None
    t = time.perf_counter(); orig(self, store, stats); cold = time.perf_counter() - t
    hot = None
    if snap is not None:
        s, st = snap
        t = time.perf_counter(); orig(self, s, st); hot = time.perf_counter() - t
    if len(REC) == 100:
        a = torch.randn(48, 3, 49)
        t = time.perf_counter()
        for _ in range(1000): a + a
        print("small add us", (time.perf_counter() - t) * 1e3, "grad", torch.is_grad_enabled(), "inference", torch.is_inference_mode_enabled(),
              "dispatch modes", torch._C._get_torch_dispatch_mode(None) if hasattr(torch._C, "_get_torch_dispatch_mode") else "?", flush=True)
        import os; print({k: v for k, v in os.environ.items() if any(x in k for x in ("OMP", "MKL", "KMP", "LD_PRELOAD", "MALLOC"))}, flush=True)
        from torch.profiler import profile
        s, st = snap2
        with profile(record_shapes=True) as p:
            orig(self, s, st)
        print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=30, max_shapes_column_width=90), flush=True)
    REC.append((tuple(store.keys.shape), cold, hot, torch.get_num_threads()))
LayerStep.decode = dec
def run_all(engines, run, settings, _json_path, out=None, err=None):
    for keepkv_settings, blocks in engines[1:]:
        REC.clear()
        row = run(keepkv_settings, blocks, None)
        print(json.dumps(row), flush=True)
        cold = [r[1] for r in REC]; hot = [(r[1], r[2]) for r in REC if r[2] is not None]
        print("calls", len(REC), "threads", REC[-1][3], "cold sum", round(sum(cold), 3), "median ms", round(statistics.median(cold)*1e3, 3))
        print("sampled cold/hot median ms", round(statistics.median(h[0] for h in hot)*1e3,3), round(statistics.median(h[1] for h in hot)*1e3,3))
        import collections
        by = collections.defaultdict(list)
        for r in REC: by[r[0]].append(r[1])
        for shape, ts in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:5]:
            print(" ", shape, len(ts), round(sum(ts),3), round(statistics.median(ts)*1e3,3))
bench.run_all = run_all
bench.main(sys.argv[1:])
