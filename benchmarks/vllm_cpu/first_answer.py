"""Seconds from ``keepkv serve`` to its first answer, keepkv against stock vLLM (serving venv):

    .venv-vllm/bin/python benchmarks/vllm_cpu/first_answer.py [--rounds 2] [--json PATH]

Each round starts ``keepkv serve --method full`` (stock vLLM under keepkv serve's flags) and the
README's ``keepkv serve --method keepkv --budget 0.1``, one after the other, each alone on the
host, and times from the command's start to its first completed chat answer (12 greedy tokens);
any other flag can follow ``--`` and goes to both. Prints one JSON line per server and the ratio
of each round.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

ENGINES = {"stock vLLM (--method full)": ["--method", "full"], "keepkv 0.1": ["--method", "keepkv", "--budget", "0.1"]}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def first_answer(flags: list[str], extra: list[str], log_path: str) -> dict:
    port = free_port()
    argv = [sys.executable, "-m", "keepkv.cli", "serve", *flags, "--host", "127.0.0.1", "--port", str(port), *extra]
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
                       "messages": [{"role": "user", "content": "What is the capital of France?"}]}).encode()
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the server stopped (status {server.returncode}): see {log_path}")
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                                 {"Content-Type": "application/json"})
                try:
                    reply = json.load(urllib.request.urlopen(request, timeout=60))
                    break
                except OSError:
                    time.sleep(1)
            seconds = time.monotonic() - start
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=60)
    return {"seconds": round(seconds, 1), "answer": reply["choices"][0]["message"]["content"],
            "load_average": os.getloadavg()[0]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("extra", nargs="*", help="flags for both servers (after --)")
    args = parser.parse_args()
    results = []
    for round_ in range(args.rounds):
        seconds = {}
        for name, flags in ENGINES.items():
            result = {"round": round_ + 1, "engine": name} | first_answer(flags, args.extra, f"/tmp/first_answer_{round_}_{flags[1]}.log")
            print(json.dumps(result), flush=True)
            results.append(result)
            seconds[name] = result["seconds"]
        stock, keepkv = seconds.values()
        print(f"round {round_ + 1}: keepkv {keepkv:.0f} s, stock {stock:.0f} s: {keepkv / stock:.2f}x", flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"command": " ".join(sys.argv), "results": results}, out, indent=1)
