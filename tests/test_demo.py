"""The demo's summary: which budget each method needs, the best cell, the table."""

from keepkv.demo import best_cell, format_demo, needed_budgets

BUDGETS = [0.5, 0.25, 0.1]


def cells(method, correct, shares=(0.5, 0.25, 0.1)):
    return [
        {"method": method, "budget": b, "correct": ok, "answer": "60494" if ok else "6022", "share": share,
         "cache_bytes": int(share * 1000), "full_cache_bytes": 1000, "kept_entries": share * 600}
        for b, ok, share in zip(BUDGETS, correct, shares)
    ]


def test_needed_budget_is_the_smallest_of_an_unbroken_run_from_the_top():
    grid = cells("a", [True, True, False]) + cells("b", [False, True, True]) + cells("c", [True, True, True])
    assert needed_budgets(grid, ["a", "b", "c"], BUDGETS) == {"a": 0.25, "b": None, "c": 0.1}


def test_best_is_least_memory_at_the_smallest_budget_any_method_keeps():
    grid = cells("a", [True, True, False]) + cells("b", [True, True, False], shares=(0.5, 0.2, 0.1))
    assert (best_cell(grid, BUDGETS)["method"], best_cell(grid, BUDGETS)["budget"]) == ("b", 0.25)
    grid += cells("c", [False, False, True], shares=(0.5, 0.25, 0.12))
    assert (best_cell(grid, BUDGETS)["method"], best_cell(grid, BUDGETS)["budget"]) == ("c", 0.1)
    assert best_cell(cells("a", [False, False, False]), BUDGETS) is None


def test_table_marks_the_best_cell_once_and_names_the_needs():
    full = {"method": "full", "budget": 1.0, "correct": True, "answer": "60494", "share": 1.0,
            "cache_bytes": 1000, "full_cache_bytes": 1000, "kept_entries": 600}
    grid = cells("a", [True, True, False]) + cells("b", [False, False, False])
    part = {"prompt_tokens": 685, "cells": [full, *grid], "needs": needed_budgets(grid, ["a", "b"], BUDGETS),
            "best": best_cell(grid, BUDGETS)}
    result = {"key": "60494", "prompt_tokens": 685, "budgets": BUDGETS, "settings": {"aware": part}}
    text = format_demo(result)
    row_a, row_b = (line for line in text.splitlines() if line.startswith(("a ", "b ")))
    assert row_a.count("*") == 1 and "25% yes*" in row_a and row_a.endswith("0.25")
    assert "*" not in row_b and row_b.endswith("more than 0.5")
    assert "best at the smallest budget that keeps the answer: a at 0.25" in text
    assert "Question inside the compressed prompt" in text and "Question after the compression" not in text
    part["best"] = None
    assert "No method kept the answer" in format_demo(result)
    # both settings: one table each, under its heading; a long variant name widens the name column
    other = {**part, "needs": {"keepkv+selection=kvzip": 0.1}, "cells": [full, *cells("keepkv+selection=kvzip", [True] * 3)]}
    text = format_demo({**result, "settings": {"aware": part, "agnostic": other}})
    assert text.index("Question inside") < text.index("Question after the compression")
    row = next(line for line in text.splitlines() if line.startswith("keepkv+selection=kvzip "))
    assert row.endswith("0.1") and "yes" in row


def test_comparison_with_the_selection_says_where_keepkv_loses_or_keeps():
    from keepkv.demo import compare_with_selection

    loses = cells("snapkv", [True, True, False]) + cells("keepkv", [True, False, False])
    assert "LOSES" in compare_with_selection(loses) and "at 0.25" in compare_with_selection(loses)
    keeps = cells("snapkv", [True, True, False]) + cells("keepkv", [True, True, True])
    text = compare_with_selection(keeps)
    assert "keeps the answer at every budget where snapkv" in text and "does not: at 0.1" in text
    neither = cells("snapkv", [False, False, False]) + cells("keepkv", [False, False, False])
    assert "at no budget" in compare_with_selection(neither)
    assert compare_with_selection(cells("keepkv", [True, True, True])) is None
