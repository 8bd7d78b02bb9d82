"""cProfile of one method on the bench's compressed shape at 128 generated tokens, without stock vLLM:
python profile.py METHOD OUT.prof [bench args] (prints the 40 functions of most own time; OUT.prof.json: the bench row)."""
import os, sys, cProfile, pstats
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import keepkv.vllm.bench as bench
method, out = sys.argv[1], sys.argv[2]
real = bench.run_all
bench.run_all = lambda engines, run, settings, json_path, out=None, err=None: real(
    [e for e in engines if e[0] is not None], run, settings, json_path, out, err)
args = ["--requests", "16", "--prompt-len", "2048", "--gen-len", "128", "--full-requests", "2", "--budget", "0.1",
        "--methods", method, "--json", out + ".json"] + sys.argv[3:]
cProfile.run("bench.main(args)", out)
s = pstats.Stats(out); s.sort_stats("tottime").print_stats(40)
