"""The bench's compressed shape for one method, no stock: python shape.py METHOD BLOCK SLACK OUT.json"""
import os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import keepkv.vllm.spec as spec
import keepkv.vllm.bench as bench
method, block, slack, out = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
spec.GROUP_SLACK = slack
real = bench.run_all
bench.run_all = lambda engines, run, settings, json_path, out=None, err=None: real(
    [e for e in engines if e[0] is not None], run, settings, json_path, out, err)
bench.main(["--requests", "16", "--prompt-len", "2048", "--gen-len", "256", "--full-requests", "2", "--budget", "0.1",
            "--block-size", block, "--methods", method, "--json", out] + sys.argv[5:])
