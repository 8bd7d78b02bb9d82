import os, sys, time, json
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPTS = ["The capital of France is", "def fibonacci(n):"]

def main():
    from vllm import LLM, SamplingParams
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    backend = sys.argv[2] if len(sys.argv) > 2 else None
    kw = dict(model="/tmp/vllm_probe/smollm2", dtype=dtype, max_model_len=2048, enforce_eager=True)
    if backend: kw["attention_backend"] = backend
    t0 = time.time()
    llm = LLM(**kw)
    t1 = time.time()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    t2 = time.time()
    print(f"RESULT init_s={t1-t0:.1f} gen_s={t2-t1:.2f}")
    for o in outs:
        print("RESULT", json.dumps(o.prompt), "->", json.dumps(o.outputs[0].text), list(o.outputs[0].token_ids))

if __name__ == "__main__":
    main()
