"""Budget 1.0, and any int budget at or above the sequence, is the identity: every registered method
and variant then keeps every entry, prefilling and decoding, and its greedy tokens are the full
cache's. 1.0 bounds nothing while decoding: the cache grows as the full cache does."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import keepkv
from keepkv.methods import MERGES, METHODS, SELECTIONS

from helpers import with_scorer
from conftest import VOCAB, run_generate, tiny_model

# Every registered method; every selection under each method's merge family (keepkv+selection=S:
# ZIP with EMA votes) and every merge under a plain selection (snapkv+merge=M); and the variants
# that change when or how a method compresses.


def builds(variant: str) -> bool:
    """A pairing the contract refuses (in one line) is no variant to test."""
    try:
        keepkv.get_method(variant)
    except ValueError:
        return False
    return True


PAIRINGS = {f"keepkv+selection={s}" for s in SELECTIONS} | {f"snapkv+merge={m}" for m in MERGES}
VARIANTS = sorted(
    {*METHODS}
    | {pairing for pairing in PAIRINGS if builds(pairing)}
    | {
        "keepkv+selection=ema+prefill_order=merge_first+protect=0+max_value_change=None+min_mass=0",  # paper-literal
        "keepkv+selection=ema+refresh_interval=4",
        "keepkv+interval=3",
        "d2o+allocation=code+merge_rule=code",
        "cam+prefill_merge=True",
        "kvreviver+estimate=sum",
        "kvreviver+allocation=uniform",
        "zeromerge+merge_slots=2",
        "kvzip+budgets=heads",
    }
)

MODELS = {kind: tiny_model(kind) for kind in ("llama-gqa", "llama-mha")}


def test_every_variant_builds():
    for variant in VARIANTS:
        keepkv.get_method(variant)


@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=4)
@given(
    kind=st.sampled_from(sorted(MODELS)),
    lengths=st.lists(st.integers(4, 96), min_size=1, max_size=2),
    new_tokens=st.integers(2, 24),
    seed=st.integers(0, 2**16),
    int_budget=st.booleans(),
    room=st.integers(0, 8),
)
def test_budget_one_is_the_full_cache(variant, kind, lengths, new_tokens, seed, int_budget, room):
    model = MODELS[kind]
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=generator)
        attention_mask[row, width - length:] = 1
    # 1.0, or an int budget at or above the longest row's whole sequence (prompt and every token).
    budget = width + new_tokens + room if int_budget else 1.0
    reference, _ = run_generate(model, input_ids, attention_mask, "full", new_tokens=new_tokens)
    tokens, cache = run_generate(model, input_ids, attention_mask, with_scorer(variant, model.config), budget=budget,
                                 new_tokens=new_tokens)
    assert torch.equal(tokens, reference), (variant, budget)
    # Nothing compressed: every real token of every row is still an entry of every layer and head.
    seen = (attention_mask.sum(-1) + new_tokens - 1)  # the last token is generated, never fed
    for layer in cache.layers:
        assert torch.equal(layer.live_counts().long(), seen[:, None].expand_as(layer.live_counts()).long()), variant
