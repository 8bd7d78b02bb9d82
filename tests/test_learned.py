"""The learned selection (KVzap-style, keepkv/methods/learned.py) and its scorer (keepkv/scorer.py,
keepkv/scorer_training.py): the fit recovers a planted score, the file round-trips and is bound to
its model's config, the selection keeps the sinks and the entries of highest predicted score, and
it runs through CompressedCache and keepkv.generate at every budget, with every merge."""

import functools
import json
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import keepkv
from keepkv.diagnostics import KeepKVWarning
from keepkv.methods import MERGES, SELECTIONS
from keepkv.methods.learned import LearnedScores
from keepkv.scorer import (
    FEATURES, Scorer, ScorerData, config_key, features, kept_overlap, load_scorer, spearman,
)
from keepkv.scorer_training import default_corpus, kvzip_scores, train_scorer

from conftest import char_tokenizer, decode_loop, prefill, random_batch, run_generate, tiny_model

LEARNED = "snapkv+selection=learned"  # the learned selection, evicting what it does not keep
LAYERS, HEADS, DIM = 2, 2, 16  # tiny_model("llama-gqa"): 2 layers, 2 KV heads of 16


def planted(seed: int, kind: str = "values+pairs"):
    """(weight [L, H, F], bias [L, H]) of a planted linear log score."""
    generator = torch.Generator().manual_seed(seed)
    width = FEATURES[kind](DIM)
    return torch.randn(LAYERS, HEADS, width, generator=generator), torch.randn(LAYERS, HEADS, generator=generator)


def synthetic_document(seed: int, weight, bias, size: int = 200, kind: str = "values+pairs"):
    """A document's (keys, values [L, H, S, D], scores [L, H, S], positions [S]) whose log scores are
    the planted linear function of its features."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, HEADS, size, DIM, generator=generator) * 2
    values = torch.randn(LAYERS, HEADS, size, DIM, generator=generator)
    log_scores = (features(keys, values, kind) * weight[:, :, None]).sum(-1) * 0.1 + bias[..., None]
    return keys, values, log_scores.exp(), torch.arange(size)


def planted_scorer(weight_on_log_norm: float = 1.0, config=None) -> Scorer:
    """A linear scorer for tiny_model("llama-gqa") whose prediction is ``weight_on_log_norm`` x log ||k||."""
    width = FEATURES["values+pairs"](DIM)
    weight = torch.zeros(LAYERS, HEADS, width)
    weight[..., -1] = weight_on_log_norm
    key = config_key(config or tiny_model("llama-gqa").config)
    tensors = {"mean": torch.zeros(LAYERS, HEADS, width), "std": torch.ones(LAYERS, HEADS, width),
               "weight": weight, "bias": torch.zeros(LAYERS, HEADS)}
    return Scorer("linear", "values+pairs", key, tensors)


@functools.cache
def trained_file(directory) -> str:
    """A scorer trained on tiny_model("llama-gqa") with keepkv's own KVzip pass, saved once."""
    model = tiny_model("llama-gqa")
    texts = [f"the {i}th line of a small text, with some words and {i * 7} numbers " * 3 for i in range(5)]
    scorer = train_scorer(model, char_tokenizer(), texts, chat=False, kind="mlp", hidden=8, epochs=2, progress=False)
    return str(scorer.save(directory / "tiny.pt"))


@pytest.fixture(scope="module")
def scorer_file(tmp_path_factory):
    return trained_file(tmp_path_factory.mktemp("scorer"))


# -- the fit -------------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**16), kind=st.sampled_from(["values+pairs", "pairs", "values"]))
def test_ridge_recovers_a_planted_linear_log_score(seed, kind):
    weight, bias = planted(seed, kind)
    data = ScorerData(LAYERS, HEADS, DIM, kind, sample=64, seed=seed)
    for doc in range(4):
        data.add(*synthetic_document(seed * 10 + doc, weight, bias, kind=kind), held_out=doc == 3)
    scorer = data.fit("linear", ridge=1e-6)
    figures = data.evaluate(scorer)
    assert figures["spearman"] > 0.999 and figures["overlap@0.1"] > 0.9
    keys, values, scores, _ = synthetic_document(seed * 10 + 7, weight, bias, kind=kind)
    predicted = torch.stack([scorer.predict(layer, keys[layer][None], values[layer][None])[0] for layer in range(LAYERS)])
    torch.testing.assert_close(predicted, scores.log(), atol=1e-3, rtol=1e-3)


def test_mlp_fits_what_linear_cannot():
    """A log score quadratic in a value coordinate: the ridge cannot follow it, its MLP residual does."""
    data = ScorerData(LAYERS, HEADS, DIM, "values", sample=400, skip=0)
    for doc in range(5):
        generator = torch.Generator().manual_seed(doc)
        values = torch.randn(LAYERS, HEADS, 400, DIM, generator=generator)
        keys = torch.randn(LAYERS, HEADS, 400, DIM, generator=generator)
        data.add(keys, values, (values[..., 0].square() - 1).exp(), torch.arange(400), held_out=doc == 4)
    linear, mlp = data.fit("linear"), data.fit("mlp", hidden=16, epochs=40, lr=1e-2)
    assert data.evaluate(linear)["spearman"] < 0.3 < 0.9 < data.evaluate(mlp)["spearman"]


def test_figures_on_known_rankings():
    target = torch.arange(10.0)
    assert float(spearman(target, target)) == pytest.approx(1.0)
    assert float(spearman(-target, target)) == pytest.approx(-1.0)
    assert float(kept_overlap(target, target, 0.2)) == 1.0
    assert float(kept_overlap(-target, target, 0.2)) == 0.0


def test_features_do_not_depend_on_the_rotary_position():
    """The key's rotary-pair norms and norm are invariant under RoPE (rotate_half layout)."""
    generator = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 5, DIM, generator=generator), torch.randn(1, 2, 5, DIM, generator=generator)
    angle = torch.rand(1, 1, 5, DIM // 2, generator=generator) * 100
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = keys * cos + torch.cat([-keys[..., DIM // 2:], keys[..., : DIM // 2]], -1) * sin
    for kind in ("values+pairs", "pairs"):
        torch.testing.assert_close(features(rotated, values, kind), features(keys, values, kind))
    # un-rotated by their positions, with the model's base, the keys come back
    positions = torch.arange(5).expand(1, 2, 5) * 7
    inverse = 1e4 ** (-torch.arange(0, DIM, 2).float() / DIM)
    angle = positions[..., None].float() * inverse
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rotated = keys * cos + torch.cat([-keys[..., DIM // 2:], keys[..., : DIM // 2]], -1) * sin
    unrotated = features(rotated, values, "unrotated+values", positions, 1e4)
    torch.testing.assert_close(unrotated, torch.cat([keys, values], -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        features(rotated, values, "unrotated+values")


def test_unrotated_keys_score_like_the_rotated_keys_of_the_same_entries(tmp_path):
    """A scorer on un-rotated keys, trained on a tiny model through keepkv's KVzip pass, scores the
    entries of a cache (stored positions = the model's, as keepkv.generate numbers them)."""
    model, tokenizer = tiny_model("llama-gqa"), char_tokenizer()
    texts = [f"line {i}: a few words of text, and more words " * 2 for i in range(4)]
    scorer = train_scorer(model, tokenizer, texts, chat=False, features="unrotated+values", progress=False)
    path = str(scorer.save(tmp_path / "unrotated.pt"))
    prompts = ["a prompt of some length for the cache, " * 3, "a shorter one, " * 3]
    results = keepkv.generate(model, tokenizer, prompts, method=LEARNED, budget=0.3, max_new_tokens=3, chat=False,
                              scorer=path)
    assert all(result.kept_entries < result.prompt_tokens for result in results)


# -- the file ------------------------------------------------------------------------------------
def test_save_and_load_round_trip(tmp_path, scorer_file):
    scorer = load_scorer(scorer_file, config=tiny_model("llama-gqa").config)
    assert scorer.kind == "mlp" and {"spearman", "overlap@0.1", "overlap@0.2"} <= set(scorer.report)
    copy = load_scorer(scorer.save(tmp_path / "copy.pt"))
    assert copy.key == scorer.key and copy.report == scorer.report
    keys, values = torch.randn(2, 3, HEADS, 7, DIM).unbind(0)
    for layer in range(LAYERS):
        assert torch.equal(copy.predict(layer, keys, values), scorer.predict(layer, keys, values))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_a_store_of_several_layers_rows_scores_each_row_by_its_layer(scorer_file, kind):
    """Rows of several layers in one store (the paged step's stacked compressions) are scored each
    by its own layer's weights, as alone; their layers are kept through a stack and a split."""
    from keepkv.store import LayerStore

    scorer = load_scorer(scorer_file)
    if kind == "linear":
        scorer = Scorer("linear", scorer.features, scorer.key, {n: scorer.tensors[n] for n in ("mean", "std", "weight", "bias")})
    generator = torch.Generator().manual_seed(3)
    heads, dim = scorer.kv_heads, scorer.head_dim
    rows = (1, 0, 1, 1 % scorer.layers)
    keys, values = (torch.randn(len(rows), heads, 7, dim, generator=generator) for _ in range(2))
    together = scorer.predict(rows, keys, values)
    for row, layer in enumerate(rows):
        alone = scorer.predict(layer, keys[row:row + 1], values[row:row + 1])[0]
        torch.testing.assert_close(together[row], alone, atol=1e-5, rtol=1e-5)
    for wrong in (rows[:3], (1, 0, -1, 1)):
        with pytest.raises(ValueError, match="row layers .* for 4 rows") as raised:
            scorer.predict(wrong, keys, values)
        assert "\n" not in str(raised.value)

    def store(layer, count):
        part = LayerStore(layer)
        part.lazy_initialization(keys[:count], values[:count])
        return part

    stacked = LayerStore.stack([store(1, 2), store(0, 1), store(1, 1)])
    assert stacked.row_layers == (1, 1, 0, 1)
    parts = stacked.split([2, 1, 1])
    assert [(p.layer_idx, p.row_layers) for p in parts] == [(1, None), (0, None), (1, None)]
    assert LayerStore.stack([store(1, 2), store(1, 1)]).row_layers is None


def test_another_models_config_is_refused_in_one_line(scorer_file):
    for other in (tiny_model("llama-mha").config, tiny_model("qwen2").config, tiny_model("llama-gqa", layers=3).config):
        with pytest.raises(ValueError, match="trained on another model") as error:
            load_scorer(scorer_file, config=other)
        assert "\n" not in str(error.value)


def test_a_scorer_that_does_not_fit_the_model_is_refused_in_one_line(scorer_file):
    model = tiny_model("llama-mha")  # 4 KV heads: the scorer has 2
    input_ids, attention_mask = random_batch()
    with pytest.raises(ValueError, match="train one for this model") as error:
        run_generate(model, input_ids, attention_mask, LEARNED, budget=8, scorer=scorer_file)
    assert "\n" not in str(error.value)
    for path in ("/nonexistent/scorer.pt", __file__):
        with pytest.raises(ValueError, match="scorer"):
            keepkv.get_method(f"{LEARNED}+scorer={path}")


# -- the selection -------------------------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_keeps_the_sinks_and_the_highest_predicted_entries(tmp_path, sign):
    """Budget 10 of rows of 24 and 18 real tokens: each row and head keeps its 4 sinks, its prompt's
    last 2 tokens (``prompt_window``) and the 4 other entries of highest predicted score (here
    ±log ||k||, ranked at the selection's resolution, the earlier slot among equals), read off a
    full cache's keys."""
    from keepkv.methods.learned import SCORE_STEP

    model = tiny_model("llama-gqa")
    path = str(planted_scorer(sign).save(tmp_path / "planted.pt"))
    input_ids, attention_mask = random_batch(pad=(0, 6))
    full = keepkv.CompressedCache(model.config, "full", 1.0)
    prefill(model, full, input_ids, attention_mask)
    cache = keepkv.CompressedCache(model.config, f"{LEARNED}+budgets=uniform", 10, scorer=path)
    prefill(model, cache, input_ids, attention_mask)
    for full_layer, layer in zip(full.layers, cache.layers):
        score = torch.round(sign * full_layer.keys.float().norm(dim=-1).log() / SCORE_STEP) * SCORE_STEP
        position = full_layer.positions
        tail = position >= attention_mask.sum(-1)[:, None, None] - 2
        score = score.masked_fill((position < 4) | tail, float("inf")).masked_fill(position < 0, float("-inf"))
        expected = position.gather(-1, score.argsort(dim=-1, descending=True, stable=True)[..., :10]).sort(-1).values
        kept = layer.positions.masked_fill(~layer.live(), 10**6).sort(-1).values[..., :10]
        assert torch.equal(kept, expected)


def test_ranks_by_the_scorer_and_protects_the_decoding_window(scorer_file):
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(pad=(0, 6))
    cache = keepkv.CompressedCache(model.config, f"{LEARNED}+budgets=uniform", 12, scorer=scorer_file)
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=6):
        pass
    for layer in cache.layers:
        positions = layer.positions.masked_fill(~layer.live(), -1)
        newest = (layer.real_seen - 1)[:, None, None]
        assert ((positions >= 0) & (positions < 4)).sum(-1).eq(4).all()  # the sinks
        assert (positions == newest).any(-1).all()  # the window's newest generated token
        assert (layer.live_counts() == 12).all()


@pytest.mark.parametrize("merge", ["none", "keepkv"])
def test_the_prompts_last_tokens_stay_at_its_compression_and_while_decoding(scorer_file, merge):
    """prompt_window=5 at budget 12 (rows of 24 and 18 real tokens): every layer and head holds each
    row's last 5 prompt tokens after its prompt's compression and after every decode step, whatever
    their scores (the sinks and the generated window leave room: 4 + 3 + 5 <= 12), and exactly its
    budget; with prompt_window=0 the scores alone rank them (the planted scorer drops some)."""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(pad=(0, 6))
    prompt_lengths = attention_mask.sum(-1)[:, None, None]

    def holds_tail(cache):
        for layer in cache.layers:
            positions = layer.positions.masked_fill(~layer.live(), -1)[..., None]  # [B, H_kv, S, 1]
            tail = prompt_lengths[..., None] - torch.arange(1, 6)  # [B, 1, 1, 5]
            if not (positions == tail).any(-2).all():
                return False
            assert (layer.live_counts() == 12).all()
        return True

    method = f"{LEARNED}+budgets=uniform+merge={merge}+interval=1"
    for steps in range(4):
        cache = keepkv.CompressedCache(model.config, f"{method}+prompt_window=5", 12, scorer=scorer_file)
        for cache in decode_loop(model, input_ids, attention_mask, cache, steps=steps):
            pass
        assert holds_tail(cache), steps
    unprotected = keepkv.CompressedCache(model.config, f"{method}+prompt_window=0", 12, scorer=scorer_file)
    for unprotected in decode_loop(model, input_ids, attention_mask, unprotected, steps=3):
        pass
    assert not holds_tail(unprotected)


def test_a_model_without_a_scorer_is_refused_in_one_line_before_any_work():
    """The shipped scorer is the embedded model's: a cache for another model is refused where it is
    built, naming what differs and how to train one."""
    model = tiny_model("llama-gqa")
    with pytest.raises(ValueError, match="shipped scorer.*trained on another model.*keepkv train-scorer") as error:
        keepkv.CompressedCache(model.config, LEARNED, 8)
    assert "\n" not in str(error.value)
    input_ids, attention_mask = random_batch()
    with pytest.raises(ValueError, match="train-scorer"):
        run_generate(model, input_ids, attention_mask, LEARNED, budget=8, new_tokens=2)


def test_layer_budgets_follow_the_predicted_scores(tmp_path):
    """budgets="layers": kvzip's split of the budget, drawn from the predicted scores: a layer whose
    predictions are all higher takes more of the budget; the mean stays the budget."""
    model = tiny_model("llama-gqa")
    scorer = planted_scorer(0.0)
    scorer.tensors["bias"][1] = 5.0  # layer 1's predictions above layer 0's
    path = str(scorer.save(tmp_path / "layers.pt"))
    input_ids, attention_mask = random_batch(pad=(0, 6))
    cache = keepkv.CompressedCache(model.config, f"{LEARNED}+budgets=layers", 10, scorer=path)
    prefill(model, cache, input_ids, attention_mask)
    budgets = cache.layer_budgets.float()
    assert (budgets[1] > budgets[0]).all() and torch.equal(budgets.mean((0, 2)), torch.tensor([10.0, 10.0]))
    assert keepkv.get_method(f"{LEARNED}+budgets=layers").allocates_from_all_layers
    assert not keepkv.get_method(LEARNED).allocates_from_all_layers  # the default split is the trained shares
    assert not keepkv.get_method(f"{LEARNED}+budgets=uniform").allocates_from_all_layers


def test_trained_shares_interpolate_between_the_measured_budgets():
    scorer = planted_scorer()
    with pytest.raises(ValueError, match="^this scorer has no layer shares") as raised:
        scorer.shares_at(torch.tensor([0.1]))
    assert "\n" not in str(raised.value)
    scorer.layer_shares = {"budgets": [0.1, 0.3], "shares": [[0.5, 1.5], [1.0, 1.0]]}
    got = scorer.shares_at(torch.tensor([0.05, 0.1, 0.2, 0.3, 0.9]))
    expected = torch.tensor([[0.5, 1.5], [0.5, 1.5], [0.75, 1.25], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert torch.allclose(got, expected)


def test_trained_budgets_split_by_the_scorers_shares_from_the_lengths_alone(tmp_path):
    """budgets="trained": each layer keeps the scorer's share of the row's budget at that fraction of
    the prompt, whatever the entries (unlike "layers", planned from the prompt's length alone), so
    a prompt compresses chunk by chunk and a serving engine runs it (its layers grouped by budget,
    each group with blocks of its own); a scorer without shares is refused in one line where the
    cache is built."""
    model = tiny_model("llama-gqa")
    scorer = planted_scorer(0.0)
    scorer.tensors["bias"][1] = 5.0  # "layers" would favour layer 1; the shares favour layer 0
    no_shares = str(scorer.save(tmp_path / "bare.pt"))
    scorer.layer_shares = {"budgets": [0.1, 1.0], "shares": [[1.5, 0.5], [1.0, 1.0]]}
    path = str(scorer.save(tmp_path / "shares.pt"))
    spec = f"{LEARNED}+budgets=trained"
    method = keepkv.get_method(f"{spec}+prompt_window=0", scorer=path)
    assert not method.allocates_from_all_layers and method.compresses_chunks and method.selection.layered
    budgets = method.allocate(2, 2, torch.tensor([4, 10]), torch.tensor([40, 100]))  # 10% of each prompt
    assert budgets[:, :, 0].tolist() == [[6, 15], [2, 5]]
    # prompt_window=2: each layer first keeps its 4 sinks and 2 prompt tokens (a row's whole budget
    # when it is smaller), the shares split the rest: 6 + 4·1.5 and 6 + 4·0.5 of the second row's 10
    windowed = keepkv.get_method(spec, scorer=path)  # the default prompt_window, 2
    budgets = windowed.allocate(2, 2, torch.tensor([4, 10]), torch.tensor([40, 100]))
    assert budgets[:, :, 0].tolist() == [[4, 12], [4, 8]]
    input_ids, attention_mask = random_batch(pad=(0, 6))
    cache = keepkv.CompressedCache(model.config, spec, 10, scorer=path)
    prefill(model, cache, input_ids, attention_mask)
    assert (cache.layer_budgets[0] > cache.layer_budgets[1]).all()
    with pytest.raises(ValueError, match="has no layer shares for budgets='trained'") as raised:
        keepkv.CompressedCache(model.config, spec, 10, scorer=no_shares)
    assert "\n" not in str(raised.value)
    from keepkv.paged import servable_method

    assert servable_method(spec).selection.budgets == "trained"  # an engine groups layers by budget


def test_needs_no_attention_statistics_and_no_pass():
    method = keepkv.get_method(LEARNED)
    assert method.needs(True) == method.needs(False) == keepkv.get_method("full").needs(True)
    assert method.protected_entries() == 4 and not method.selection.reads_every_entry
    assert SELECTIONS["learned"] is LearnedScores


BUDGETS = st.one_of(st.integers(1, 40), st.sampled_from([0.05, 0.1, 0.3, 0.5, 0.9, 1.0]))


@given(budget=BUDGETS, interval=st.integers(1, 4), merge=st.sampled_from(sorted(MERGES)),
       split=st.sampled_from(["uniform", "layers", "global", "heads", "trained"]))
def test_every_row_and_head_keeps_exactly_its_budget_with_any_merge(scorer_file, budget, interval, merge, split):
    """Rows of 30, 21 and 10 real tokens, 8 decode steps: each row and head of each layer holds
    min(its budget + the tokens since its last compression, its tokens), with every merge that
    pairs and every split of the budget over layers and heads (kvzip's)."""
    model = tiny_model("llama-gqa")
    spec = f"{LEARNED}+merge={merge}+interval={interval}+budgets={split}"
    try:
        keepkv.get_method(spec, scorer=scorer_file)
    except ValueError as error:  # a pair the contract refuses, in one line
        assert "\n" not in str(error)
        return
    input_ids, attention_mask = random_batch(batch=3, length=30, pad=(0, 9, 20))
    cache = keepkv.CompressedCache(model.config, spec, budget, scorer=scorer_file)
    for cache in decode_loop(model, input_ids, attention_mask, cache, steps=8):
        for layer in cache.layers:
            kept = layer.live_counts()
            if layer.budget is None:
                assert torch.equal(kept, layer.real_seen[:, None].expand_as(kept))
            else:
                assert torch.equal(kept, torch.minimum(layer.budget + layer.pending, layer.real_seen[:, None]))


@pytest.mark.parametrize("budget", [1, 5, 0.3, 1.0])
def test_generate_batch_rows_equal_single_prompts(scorer_file, budget):
    """keepkv.generate-like greedy decoding of unequal rows: each row decodes as it does alone."""
    model = tiny_model("llama-gqa")
    input_ids, attention_mask = random_batch(length=30, pad=(0, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KeepKVWarning)  # budget 1 is below the sinks on purpose
        batched, _ = run_generate(model, input_ids, attention_mask, LEARNED, budget, 8, scorer=scorer_file)
        for row in range(2):
            real = attention_mask[row].bool()
            alone, _ = run_generate(model, input_ids[row : row + 1, real], attention_mask[row : row + 1, real],
                                    LEARNED, budget, 8, scorer=scorer_file)
            assert torch.equal(batched[row], alone[0]), row


def test_keepkv_generate_and_compress(scorer_file):
    model, tokenizer = tiny_model("llama-gqa"), char_tokenizer()
    prompts = ["a prompt of a hundred characters or so, " * 3, "another, shorter prompt " * 3]
    results = keepkv.generate(model, tokenizer, prompts, method=LEARNED, budget=0.3, max_new_tokens=4, chat=False, scorer=scorer_file)
    assert len(results) == 2 and results[0].kept_entries < results[0].prompt_tokens
    cache = keepkv.compress(model, tokenizer, "a context of a hundred characters or so " * 3, method=LEARNED,
                            budget=0.3, chat=False, scorer=scorer_file)
    assert all(int(layer.live_counts().max()) < layer.real_seen.max() for layer in cache.layers)


# -- training on a model -------------------------------------------------------------------------
def test_targets_are_the_kvzip_selections_own_scores():
    """kvzip_scores hands back what the kvzip method ranks by: a kvzip cache at a budget that keeps
    half the entries keeps those of highest target score (beyond its sinks)."""
    model, tokenizer = tiny_model("llama-gqa"), char_tokenizer()
    text = "some text to be scored by the reconstruction pass of kvzip"
    keys, values, scores, positions = kvzip_scores(model, tokenizer, text, chat=False)
    assert keys.shape[:3] == scores.shape and scores.shape[-1] == positions.numel() == len(text)
    ids = torch.tensor([char_tokenizer()(text, add_special_tokens=False)["input_ids"]])
    cache = keepkv.CompressedCache(model.config, "kvzip+budgets=uniform", 20)
    keepkv.enable(model)
    keepkv.reconstruction.prefill(model, tokenizer, cache, ids, torch.ones_like(ids), chat=False)
    for layer, score in zip(cache.layers, scores):
        ranked = score.masked_fill(positions < 4, float("inf")).topk(20, dim=-1).indices.sort(-1).values
        assert torch.equal(layer.positions[0].sort(-1).values, positions[ranked])


def test_train_scorer_reports_held_out_figures(tmp_path):
    model = tiny_model("llama-gqa")
    texts = [f"text number {i}: " + "some words and letters " * 4 for i in range(10)]
    scorer = train_scorer(model, char_tokenizer(), texts, chat=False, kind="linear", progress=False,
                          save=tmp_path / "s.pt")
    report = scorer.report
    assert report["heldout_documents"] == 1 and report["train_documents"] == 9
    assert -1 <= report["spearman"] <= 1 and 0 <= report["overlap@0.2"] <= 1
    assert load_scorer(tmp_path / "s.pt", config=model).report == report
    shares = load_scorer(tmp_path / "s.pt").layer_shares  # KVzip's layer split of its predictions
    assert len(shares["shares"]) == len(shares["budgets"]) and all(len(row) == 2 for row in shares["shares"])
    assert all(abs(sum(row) / 2 - 1) < 1e-3 for row in shares["shares"]) and shares["shares"][-1] == [1.0, 1.0]


def test_default_corpus_is_offline_text():
    texts = default_corpus(4, chars=1000)
    assert len(texts) == 4 and all(500 < len(text) <= 1000 for text in texts)
    assert "def " in texts[1] or "import" in texts[1] or "class " in texts[1]  # a stdlib source
    assert default_corpus(4, chars=1000) == texts


# -- the embedded model's scorer -------------------------------------------------------------------
@pytest.mark.integration
def test_the_shipped_scorer_fits_the_embedded_model():
    """scorer=None on the embedded model: the shipped scorer, bound to its config, no warning, and a
    held-out fit far above the untrained prior's."""
    from keepkv.scorer import default_scorer

    try:
        model, tokenizer = keepkv.load_model()
    except Exception as error:  # noqa: BLE001 (no embedded model in this environment)
        pytest.skip(f"embedded model unavailable: {error}")
    scorer = load_scorer(default_scorer(), config=model.config)
    assert scorer.report["spearman"] > 0.5 and scorer.report["documents"] >= 50
    context = "The passcode is 4417. " + "Some filler prose about nothing in particular. " * 20
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeepKVWarning)
        cache = keepkv.compress(model, tokenizer, context, method=LEARNED, budget=0.3)
    kept = sum(int(layer.live_counts().sum()) for layer in cache.layers)  # layers split the budget unevenly
    assert kept < 0.5 * sum(int(layer.real_seen.sum()) * layer.keys.shape[1] for layer in cache.layers)


@pytest.mark.integration
def test_the_command_line_trains_a_scorer_for_the_embedded_model(tmp_path, capsys):
    """`keepkv train-scorer` on two small files: a held-out fit printed as JSON, a file bound to the
    embedded model that the selection then runs on."""
    from keepkv.cli import main
    from keepkv.models import load_model

    files = []
    for index, text in enumerate(default_corpus(2, 600, seed=3)):
        files.append(tmp_path / f"doc{index}.txt")
        files[-1].write_text(text)
    out = tmp_path / "scorer.pt"
    assert main(["train-scorer", "--files", *map(str, files), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(out) and report["heldout_documents"] == 1 and -1 <= report["spearman"] <= 1
    model, tokenizer = load_model()
    load_scorer(out, config=model.config)
    cache = keepkv.compress(model, tokenizer, "A short note. " * 30, f"{LEARNED}+scorer={out}", 0.3)
    assert cache.layers[0].live_counts().max() < cache.layers[0].seen
