"""Paired differences of the learned selection with prompt_window against kvzip, snapkv and itself
without it, on the dev grid (seed 1001, 32 prompts per task): this record's cells
(dev_grid.json) and the learned-grid record's kvzip and snapkv cells, the same prompts
(../learned_grid/per_prompt_scores.json). Prints one markdown table per setting.

    python docs/record/data/learned_prompt_window/analyse.py
"""

import json
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OURS = json.load(open(os.path.join(HERE, "dev_grid.json")))
THEIRS = json.load(open(os.path.join(HERE, "..", "learned_grid", "per_prompt_scores.json")))
LEARNED = "snapkv+selection=learned"
TASKS = {"needle": "needle", "needle+haystack=prose+digits=5": "prose needle", "passkey": "pass key"}


def ours(setting, task, method, budget):
    suite = task if setting == "aware" else task + "+setting=agnostic"
    cell = OURS.get(f"{suite}|{method}|{budget}")
    return None if cell is None else [1 if (s or 0) >= 1 else 0 for s in cell["per_prompt"]]


def theirs(setting, task, method, budget):
    suite = task if setting == "aware" else task + "+setting=agnostic"
    bits = THEIRS[setting].get(suite, {}).get(f"{method}@{budget}")
    return None if bits is None else [int(b) for b in bits]


def paired(a, b):
    """mean difference of a - b per prompt, 95% half-width (normal), as counts of n."""
    d = [x - y for x, y in zip(a, b)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / max(1, n - 1)
    return sum(d), 1.96 * math.sqrt(var / n) * n


def main():
    windows = [0, 1, 2, 4, 8, 12, 16, 32, 64]
    for setting in ("aware", "agnostic"):
        print(f"\n### {setting}: found of 32 (budgets 0.1 / 0.2 / 0.25)\n")
        print("| method | " + " | ".join(f"{TASKS[t]} @{b}" for t in TASKS for b in (0.1, 0.2, 0.25)) + " | sum |")
        print("| --- |" + " ---: |" * 10)
        for label, get in [("kvzip", lambda t, b: theirs(setting, t, "kvzip", b)),
                           ("snapkv", lambda t, b: theirs(setting, t, "snapkv", b))] + [
                (f"learned, prompt_window={w}", (lambda w: lambda t, b: ours(setting, t, LEARNED if w == 0 else f"{LEARNED}+prompt_window={w}", b))(w))
                for w in windows] + [
                ("keepkv+selection=learned (window 2)", lambda t, b: ours(setting, t, "keepkv+selection=learned", b)),
                ("learned, budgets=uniform (window 2)", lambda t, b: ours(setting, t, f"{LEARNED}+budgets=uniform", b))]:
            cells = [get(t, b) for t in TASKS for b in (0.1, 0.2, 0.25)]
            if all(c is None for c in cells):
                continue
            print(f"| {label} | " + " | ".join("-" if c is None else str(sum(c)) for c in cells)
                  + f" | {sum(sum(c) for c in cells if c is not None)} |")
        merged, alone = "keepkv+selection=learned", f"{LEARNED}+prompt_window=2"
        row = []
        for t in TASKS:
            for b in (0.1, 0.2, 0.25):
                a, other = ours(setting, t, merged, b), ours(setting, t, alone, b)
                row.append("-" if a is None or other is None else "{:+d} ± {:.1f}".format(*paired(a, other)))
        print(f"\nkeepkv+selection=learned − snapkv+selection=learned (both window 2): " + " | ".join(row))
        for w in (2,):
            print(f"\nprompt_window={w}, paired difference (count of 32 ± 95% half-width) against:\n")
            print("| against | " + " | ".join(f"{TASKS[t]} @{b}" for t in TASKS for b in (0.1, 0.2, 0.25)) + " |")
            print("| --- |" + " --- |" * 9)
            for label, get in [("kvzip", lambda t, b: theirs(setting, t, "kvzip", b)),
                               ("snapkv", lambda t, b: theirs(setting, t, "snapkv", b)),
                               ("prompt_window=0", lambda t, b: ours(setting, t, LEARNED, b))]:
                row = []
                for t in TASKS:
                    for b in (0.1, 0.2, 0.25):
                        a, other = ours(setting, t, f"{LEARNED}+prompt_window={w}", b), get(t, b)
                        if a is None or other is None:
                            row.append("-")
                            continue
                        total, half = paired(a, other)
                        row.append(f"{total:+d} ± {half:.1f}")
                print(f"| {label} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
