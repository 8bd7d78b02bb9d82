"""Output perturbation of a compression method: KeepKV's central measurement (Theorems 2/3, Fig. 2d).

At the compression step (the end of prefill) the last prompt query's attention output is
recomputed, layer by layer, on the compressed cache and on the full cache of the same run, and
compared: ``||o' - o|| / ||o||``. This is the paper's "recompute step t on the compressed cache"
view (Appendix C.2): for a lossless merge (Theorem 3, exact scores, MHA) it is zero up to
rounding; eviction and convex merging cannot make it zero (eq. 4, Theorem 2).

Later steps k: the full-cache greedy continuation is teacher-forced into both a full-cache run
and the compressed run, and each layer's attention output at decode step k is compared between
the two runs (``later[k]``; this includes the error carried in through earlier layers and
steps). ``later[k]["isolated"]`` is the same step's error with no propagation: the compressed
run's own query and output against attention over every K/V that run appended (Theorem 5's
Θ_t').

Hooks: the cache's ``forward_layer`` is wrapped on the instance (no change to cache.py or
attention.py); recomputations attend over ``method.attention_entries(layer)``, so any method,
KVReviver's rebuilt tokens included, is measured as it attends.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from tqdm.auto import tqdm

from .attention import enable
from .cache import CompressedCache
from .methods import Method, get_method
from .models import CACHE_KWARG

FACT = "The secret code for the vault is 4817-AZURE."
QUESTION = "\n\nQuestion: What is the secret code for the vault?\nAnswer: The secret code for the vault is"
AGGREGATE = (
    "per layer: ||o' - o|| / ||o|| of the layer's attention output (all query heads and dims), "
    "averaged over batch rows; overall: mean over layers"
)


def builtin_document(tokenizer=None, tokens: int = 1000) -> str:
    """A deterministic ~``tokens``-token prompt: ``pydoc_data.topics`` prose with a hidden fact.

    Paragraphs of the topics, in name order, are taken until the length is reached; the fact
    ("The secret code for the vault is 4817-AZURE.") sits after the middle paragraph and a
    question about it ends the prompt. Token counts use ``tokenizer`` when given, else 4
    characters per token.
    """
    from pydoc_data.topics import topics

    def count(text: str) -> int:
        if tokenizer is None:
            return max(1, len(text) // 4)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    room = tokens - count(FACT) - count(QUESTION) - 2
    chosen: list[str] = []
    used = 0
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            text = re.sub(r"\s+", " ", block).strip()
            if len(text) < 80 or not text[0].isalpha():
                continue
            size = count(text + "\n\n")
            if used + size > room:
                break
            chosen.append(text)
            used += size
        else:
            continue
        break
    middle = len(chosen) // 2
    chosen.insert(middle, FACT)
    return "\n\n".join(chosen) + QUESTION


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scaling: float):
    """fp32 softmax(q·K·scaling + bias)·V of one query per head over all entries.

    query [B, H, D]; keys, values [B, H_kv, S, D]; bias [B, H_kv, S] -> [B, H, D].
    """
    batch, heads, head_dim = query.shape
    kv_heads = keys.shape[1]
    q = query.float().view(batch, kv_heads, heads // kv_heads, head_dim)
    logits = q @ keys.float().transpose(-1, -2) * scaling + bias.float()[:, :, None]
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return (probs @ values.float()).reshape(batch, heads, -1)


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """Mean over rows of ||approx - exact|| / ||exact|| (norm over every other axis)."""
    diff = (approx.float() - exact.float()).flatten(1).norm(dim=-1)
    scale = exact.float().flatten(1).norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
    return float((diff / scale).mean())


class _Recorder:
    """Observes a cache's attention calls (``CompressedCache.observers``) to record queries,
    appended K/V and attention outputs."""

    def __init__(self, cache: CompressedCache, steps):
        self.cache = cache
        self.steps = set(steps)
        cache.observers.append(self.observe)
        self.step = 0
        self.scaling: dict[int, float] = {}
        self.last_query: dict[int, torch.Tensor] = {}  # layer -> [B, H, D] last prompt query
        self.appended: dict[int, list] = {}  # layer -> [(keys, values, key_is_real)]
        self.outputs: dict[int, dict[int, torch.Tensor]] = {}  # step -> layer -> [B, H, D]
        self.isolated: dict[int, dict[int, float]] = {}  # step -> layer -> error

    def full_entries(self, layer_idx: int):
        """Every K/V this run appended to a layer: keys, values [B, H_kv, T, D], bias [B, H_kv, T]."""
        blocks = self.appended[layer_idx]
        keys = torch.cat([b[0] for b in blocks], dim=2)
        values = torch.cat([b[1] for b in blocks], dim=2)
        real = torch.cat([b[2] for b in blocks], dim=1)
        bias = torch.zeros(real.shape, device=keys.device).masked_fill(~real, float("-inf"))
        return keys, values, bias[:, None].expand(-1, keys.shape[1], -1)

    def observe(self, layer_idx, query, keys, values, block_mask, scaling, output, is_prefill):
        self.scaling[layer_idx] = scaling
        self.appended.setdefault(layer_idx, []).append((keys.detach(), values.detach(), block_mask[:, 0, -1, :].clone()))
        if is_prefill:
            self.last_query[layer_idx] = query[:, :, -1].detach()
        elif self.step in self.steps:
            out = output[:, -1]  # [B, H, D]
            self.outputs.setdefault(self.step, {})[layer_idx] = out.detach()
            full = _attend(query[:, :, -1], *self.full_entries(layer_idx), scaling)
            self.isolated.setdefault(self.step, {})[layer_idx] = _relative(out, full)


@torch.no_grad()
def recompute_logits(model, cache: CompressedCache, token: torch.Tensor, position: int) -> torch.Tensor:
    """Next-token logits of ``token`` [B, 1] at ``position``, attending over the cache as it is.

    Nothing is appended and the method does not run: every layer attends over its stored
    entries (``method.attention_entries``), which must already hold the token itself. This is
    "step t recomputed on the compressed cache" (Theorem 3's statement). Returns fp32 [B, V].
    """
    enable(model)
    previous = cache.__dict__.get("forward_layer")

    def frozen(layer_idx, query, keys, values, block_mask, scaling):
        layer = cache.layers[layer_idx]
        entries = cache.method.attention_entries(layer)
        out = _attend(query[:, :, -1], *entries, scaling)
        return out[:, None].to(query.dtype)

    cache.forward_layer = frozen
    try:
        positions = torch.full_like(token, position)
        logits = model(input_ids=token, position_ids=positions, **{CACHE_KWARG: cache}).logits
    finally:
        if previous is None:
            del cache.forward_layer
        else:
            cache.forward_layer = previous
    return logits[:, -1].float()


def _prompt_ids(model, tokenizer, prompt) -> torch.Tensor:
    device = next(model.parameters()).device
    if prompt is None:
        if tokenizer is None:
            raise ValueError("the built-in document needs a tokenizer; pass token ids as prompt for a model without one")
        prompt = builtin_document(tokenizer)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer")
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"prompt must be one sequence of at least 2 tokens, got shape {tuple(ids.shape)}")
    return ids.to(device)


@torch.no_grad()
def perturbation(
    model,
    tokenizer=None,
    prompt=None,
    method: str | Method = "keepkv",
    budget: int | float = 0.1,
    steps=(1, 8, 64),
    progress: bool = False,
    **method_params,
) -> dict:
    """Per-layer attention-output error of ``method`` at the compression step and k steps later.

    Parameters
    ----------
    model : a supported causal LM (switched to keepkv's attention path).
    tokenizer : its tokenizer; needed for a text prompt or the built-in document.
    prompt : str, token ids (list or [1, T] tensor), or None for :func:`builtin_document`.
    method : a registered method name or a Method instance.
    budget : the cache budget (float fraction of the prompt or int entries).
    steps : decode steps k >= 1 at which the later error is measured.
    progress : show a progress bar on stderr, a tick per forward pass (two prefills, then the
        decode steps of the full and of the compressed run; minutes on a 1k-token prompt).
    **method_params : parameters of the method when given by name.

    Returns
    -------
    dict (JSON-able) with
        overall : float, mean over layers of the per-layer error at the compression step;
        layers : list of per-layer errors ||o' - o|| / ||o|| of the last prompt query, its
            output recomputed on the compressed cache vs the full cache;
        logits_error : relative L2 error of the next-token logits recomputed on the compressed
            cache (vs the full cache), same step;
        later : {k: {overall, layers, isolated: {overall, layers}}}, see the module docstring;
        method, params, budget, prompt_tokens, kept_entries (mean live entries per layer and
        KV head after compression), aggregate (how the numbers are aggregated).
    """
    if isinstance(steps, int):
        steps = (steps,)
    steps = sorted(set(steps))
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in steps):
        raise ValueError(f"steps must be ints >= 1, got {steps!r}")
    if isinstance(method, str):
        method = get_method(method, **method_params)
    elif method_params:
        raise ValueError("pass method parameters either with a method name or inside the Method instance")
    if CompressedCache(model.config, method, budget).defers_to_reconstruction:
        raise ValueError(f"perturbation measures the compression inside a prefill's attention call; {method.name} "
                         "compresses after its reconstruction pass: measure it with keepkv eval (kl suites)")
    method.prepare(model)
    enable(model)
    ids = _prompt_ids(model, tokenizer, prompt)
    length = ids.shape[1]
    last_token = ids[:, -1:]
    horizon = max(steps, default=0)

    bar = tqdm(total=2 * (horizon + 1), desc=f"{method.name or type(method).__name__}: perturbation",
               unit="pass", leave=False, disable=not progress)

    # Full cache: the reference outputs and the greedy continuation.
    full_cache = CompressedCache(model.config, "full", 1.0)
    full = _Recorder(full_cache, steps)
    logits = model(input_ids=ids, **{CACHE_KWARG: full_cache}).logits[:, -1]
    bar.update(1)
    full_logits = recompute_logits(model, full_cache, last_token, length - 1)
    tokens = []
    for k in range(1, horizon + 1):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        full.step = k
        logits = model(input_ids=token, **{CACHE_KWARG: full_cache}).logits[:, -1]
        bar.update(1)

    # Compressed cache, fed the same tokens.
    cache = CompressedCache(model.config, method, budget)
    run = _Recorder(cache, steps)
    model(input_ids=ids, **{CACHE_KWARG: cache})
    bar.update(1)
    layers = []
    for layer in cache.layers:
        index = layer.layer_idx
        query, scaling = run.last_query[index], run.scaling[index]
        reference = _attend(query, *run.full_entries(index), scaling)
        compressed = _attend(query, *cache.method.attention_entries(layer), scaling)
        layers.append(_relative(compressed, reference))
    kept = float(torch.stack([layer.live_counts().double().mean() for layer in cache.layers]).mean())
    compressed_logits = recompute_logits(model, cache, last_token, length - 1)
    for k, token in enumerate(tokens, start=1):
        run.step = k
        model(input_ids=token, **{CACHE_KWARG: cache})
        bar.update(1)
    bar.close()

    later = {}
    for k in steps:
        per_layer = [_relative(run.outputs[k][i], full.outputs[k][i]) for i in range(cache.num_layers)]
        isolated = [run.isolated[k][i] for i in range(cache.num_layers)]
        later[k] = {
            "overall": sum(per_layer) / len(per_layer),
            "layers": per_layer,
            "isolated": {"overall": sum(isolated) / len(isolated), "layers": isolated},
        }
    return {
        "method": method.name or type(method).__name__,
        "params": dataclasses.asdict(method),
        "budget": budget,
        "prompt_tokens": int(length),
        "kept_entries": kept,
        "overall": sum(layers) / len(layers),
        "layers": layers,
        "logits_error": _relative(compressed_logits, full_logits),
        "later": later,
        "aggregate": AGGREGATE,
    }


def format_perturbation(result: dict) -> str:
    """A plain-text table of :func:`perturbation`'s result."""
    steps = list(result["later"])
    lines = [
        f"perturbation of {result['method']} at budget {result['budget']} "
        f"({result['prompt_tokens']} prompt tokens, {result['kept_entries']:.1f} entries kept per layer and KV head)",
        "relative attention-output error ||o' - o|| / ||o||; 'compress' = last prompt query recomputed on the",
        "compressed cache; '+k' = decode step k vs a full-cache run fed the same tokens; 'iso+k' = same step,",
        "the compressed run's query against all the K/V it appended (no propagation)",
    ]
    header = ["layer", "compress"] + [f"+{k}" for k in steps] + [f"iso+{k}" for k in steps]
    rows = []
    for i, value in enumerate(result["layers"]):
        row = [str(i), value]
        row += [result["later"][k]["layers"][i] for k in steps]
        row += [result["later"][k]["isolated"]["layers"][i] for k in steps]
        rows.append(row)
    overall = ["overall", result["overall"]] + [result["later"][k]["overall"] for k in steps]
    overall += [result["later"][k]["isolated"]["overall"] for k in steps]
    rows.append(overall)
    cells = [header] + [[r[0]] + [f"{v:.3e}" for v in r[1:]] for r in rows]
    widths = [max(len(row[c]) for row in cells) for c in range(len(header))]
    for row in cells:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))
    lines.append(f"next-token logits recomputed on the compressed cache: {result['logits_error']:.3e} relative error")
    return "\n".join(lines)
