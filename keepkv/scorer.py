"""The learned selection's scorer: per-entry features, a per-layer and per-KV-head model that
predicts an entry's log KVzip score from them, its fit, and its file (KVzap, arXiv 2601.07891:
a linear model or a small MLP per layer predicting log KVzip scores, so that no second pass runs).

Features are what every path has at a layer, entry by entry: its key after RoPE and its value,
[B, H_kv, S, D]. The default set, ``"values+pairs"``, is per KV head

    [ v (D) | ||(k_i, k_{i+D/2})|| for i < D/2 (D/2) | log ||k|| (1) ]

RoPE rotates each pair (k_i, k_{i+D/2}) (Hugging Face's ``rotate_half`` layout) by an angle set
by the position, so the pairs' norms, and the key's norm, do not depend on it: the position does
not leak in, and an entry's score is a function of that entry alone (a chunked prefill, or a
compression chunk by chunk, scores it as a whole prompt does). ``FEATURES`` has the others;
``"unrotated+values"`` turns each key back by its stored position (the model's default RoPE,
base ``rope_theta`` from the scorer's config key): the whole key before RoPE, still free of the
position, but right only where the model numbered the tokens as the store does (each row's real
tokens from 0, as ``model.generate`` and ``keepkv.generate`` do; not a padded batch fed without
``position_ids``).

A :class:`Scorer` holds, for L layers and H KV heads of F features: ``mean``, ``std`` [L, H, F]
(the training features' standardisation) and either ``weight`` [L, H, F], ``bias`` [L, H]
(``kind="linear"``) or those plus ``w1`` [L, H, F, M], ``b1`` [L, H, M], ``w2`` [L, H, M]
(``kind="mlp"``: the linear model plus a one-hidden-layer MLP on the same standardised features).
Its file (:meth:`Scorer.save`, :func:`load_scorer`; ``torch.save`` of tensors, strings and
numbers, read with ``weights_only=True``) carries the key of the model config it was trained on
(:func:`config_key`), and loading it for another config is refused in one line.

:class:`ScorerData` gathers (features, log score) pairs, document by document, and fits them
(:meth:`ScorerData.fit`: closed-form ridge, then Adam for the MLP), and scores held-out documents
(Spearman rank correlation with KVzip's scores, overlap of the kept sets).
:mod:`keepkv.scorer_training` runs KVzip on a corpus to feed it.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

KINDS = ("linear", "mlp")
# Feature sets: name -> features per KV head, as a function of the head size D.
FEATURES = {
    "values+pairs": lambda d: d + d // 2 + 1,  # the value, the key's rotary-pair norms, log ||k||
    "pairs": lambda d: d // 2 + 1,  # the key's rotary-pair norms and log ||k|| (the key alone, RoPE-invariant)
    "values": lambda d: d,  # the value alone
    "unrotated+values": lambda d: 2 * d,  # the key before RoPE (un-rotated by its position) and the value
    "keys+values": lambda d: 2 * d,  # the rotated key and the value: the position leaks in (a baseline)
}
NEEDS_POSITIONS = ("unrotated+values",)  # feature sets that read the positions and the RoPE base
TINY = 1e-12  # norms and scores are clamped here before a log
FORMAT = 1  # the file's layout version
# The config fields a scorer is bound to (config_key).
KEY_FIELDS = ("architecture", "layers", "kv_heads", "head_dim", "hidden_size", "rope_theta", "vocab_size")


def config_key(config) -> dict:
    """What a scorer is bound to of a model's config (or of the model): its architecture, layers,
    KV heads, head size, hidden size, RoPE base and vocabulary."""
    if isinstance(config, torch.nn.Module) and hasattr(config, "config"):
        config = config.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_theta", None)
    if rope is None:
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    architectures = getattr(config, "architectures", None) or [getattr(config, "model_type", "")]
    return {
        "architecture": str(architectures[0]), "layers": int(config.num_hidden_layers),
        "kv_heads": int(config.num_key_value_heads), "head_dim": int(head_dim),
        "hidden_size": int(config.hidden_size), "rope_theta": None if rope is None else float(rope),
        "vocab_size": int(config.vocab_size),
    }


def unrotate(keys: torch.Tensor, positions: torch.Tensor, rope_theta: float) -> torch.Tensor:
    """[..., S, D] fp32 keys before RoPE: keys after it [..., S, D] turned back by their positions
    [..., S] (Hugging Face's default RoPE, ``rotate_half`` layout, base ``rope_theta``)."""
    keys = keys.float()
    dim = keys.shape[-1]
    inverse = rope_theta ** (-torch.arange(0, dim, 2, device=keys.device, dtype=torch.float32) / dim)
    angle = positions.float()[..., None] * inverse  # [..., S, D/2]
    cos, sin = angle.cos().repeat(*(1,) * (angle.dim() - 1), 2), angle.sin().repeat(*(1,) * (angle.dim() - 1), 2)
    half = dim // 2
    rotated_half = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return keys * cos - rotated_half * sin


def features(keys: torch.Tensor, values: torch.Tensor, kind: str = "values+pairs", positions: torch.Tensor | None = None,
             rope_theta: float | None = None) -> torch.Tensor:
    """[..., S, F] fp32 features of entries: keys (after RoPE), values [..., S, D] (``FEATURES``);
    ``positions`` [..., S] and ``rope_theta``: for the sets that un-rotate the keys (``NEEDS_POSITIONS``)."""
    keys, values = keys.float(), values.float()
    if kind in NEEDS_POSITIONS:
        if positions is None or rope_theta is None:
            raise ValueError(f"features {kind!r} need the entries' positions and the model's rope_theta")
        return torch.cat([unrotate(keys, positions, rope_theta), values], dim=-1)
    if kind == "values":
        return values
    if kind == "keys+values":
        return torch.cat([keys, values], dim=-1)
    half = keys.shape[-1] // 2
    pairs = (keys[..., :half].square() + keys[..., half : 2 * half].square()).clamp_min(TINY).sqrt()
    log_norm = 0.5 * keys.square().sum(-1, keepdim=True).clamp_min(TINY).log()
    parts = [pairs, log_norm] if kind == "pairs" else [values, pairs, log_norm]
    return torch.cat(parts, dim=-1)


def log_targets(scores: torch.Tensor) -> torch.Tensor:
    """The regression target of KVzip scores (probabilities in [0, 1]): their log, clamped at 1e-12."""
    return scores.float().clamp_min(TINY).log()


def prior_scores(keys: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, S] what an untrained scorer ranks by: minus log ||k|| (K-norm's rule, Devoto et al.
    2024: a low-norm key draws high attention), for a model no scorer was trained on."""
    return -0.5 * keys.float().square().sum(-1).clamp_min(TINY).log()


@dataclass
class Scorer:
    """A per-layer, per-KV-head model of log KVzip scores (module docstring: tensors and shapes).

    ``key``: the model config it was trained on (:func:`config_key`); ``report``: figures of its
    fit (held-out Spearman, kept-set overlaps, documents, seconds), as numbers and strings."""

    kind: str
    features: str
    key: dict
    tensors: dict[str, torch.Tensor]
    report: dict = field(default_factory=dict)
    layer_shares: dict = field(default_factory=dict)
    """KVzip's layer split of its predictions on typical documents (``budgets="trained"``):
    {"budgets": [NB] budget fractions, "shares": [NB][L] each layer's budget over the mean}; empty
    in a file saved before it was measured."""
    _placed: dict = field(default_factory=dict, repr=False, compare=False)  # device -> tensors there

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"scorer kind must be one of {', '.join(map(repr, KINDS))}, got {self.kind!r}")
        if self.features not in FEATURES:
            raise ValueError(f"scorer features must be one of {', '.join(map(repr, FEATURES))}, got {self.features!r}")

    @property
    def layers(self) -> int:
        return self.tensors["mean"].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.tensors["mean"].shape[1]

    @property
    def head_dim(self) -> int:
        return int(self.key["head_dim"])

    def fits(self, layer_idx: int, kv_heads: int, head_dim: int, first_head: int = 0) -> bool:
        """Whether it scores layer ``layer_idx`` of ``kv_heads`` heads of size ``head_dim`` from the
        model's head ``first_head`` (all of the model's heads, or a tensor-parallel rank's)."""
        return layer_idx < self.layers and head_dim == self.head_dim and first_head + kv_heads <= self.kv_heads

    def shares_at(self, fractions: torch.Tensor) -> torch.Tensor:
        """[B, L] fp64 each layer's budget over the mean at budgets ``fractions`` [B] of the prompt:
        :attr:`layer_shares` interpolated linearly between the measured budgets (the nearest at
        either end). ValueError, in one line, when none were measured."""
        if not self.layer_shares:
            raise ValueError("this scorer has no layer shares (budgets='trained'): train it again with "
                             "`keepkv train-scorer`, which measures them")
        grid = torch.tensor(self.layer_shares["budgets"], dtype=torch.float64)
        table = torch.tensor(self.layer_shares["shares"], dtype=torch.float64)  # [NB, L]
        at = fractions.detach().double().cpu().clamp(float(grid[0]), float(grid[-1]))
        upper = torch.searchsorted(grid, at).clamp(1, len(grid) - 1)
        lower = upper - 1
        weight = ((at - grid[lower]) / (grid[upper] - grid[lower]))[:, None]
        return table[lower] * (1 - weight) + table[upper] * weight

    def _on(self, device) -> dict[str, torch.Tensor]:
        device = torch.device(device)
        if device not in self._placed:
            self._placed[device] = {name: t.to(device, torch.float32) for name, t in self.tensors.items()}
        return self._placed[device]

    def predict(self, layer_idx: int | tuple[int, ...], keys: torch.Tensor, values: torch.Tensor,
                positions: torch.Tensor | None = None, first_head: int = 0) -> torch.Tensor:
        """[B, H_kv, S] fp32 predicted log KVzip scores of layer ``layer_idx``'s entries (or, a tuple
        [B], of each row's layer: a store of several layers' rows): keys (after RoPE), values
        [B, H_kv, S, D], positions [B, H_kv, S] (read by the feature sets that un-rotate the keys);
        the H_kv heads are the model's from ``first_head`` (a rank's)."""
        kv_heads = keys.shape[1]
        rows = isinstance(layer_idx, tuple)
        if rows and (len(layer_idx) != keys.shape[0] or min(layer_idx, default=0) < 0):
            raise ValueError(f"predict: row layers {layer_idx} for {keys.shape[0]} rows (one layer >= 0 a row)")
        if not self.fits(max(layer_idx) if rows else layer_idx, kv_heads, keys.shape[-1], first_head):
            heads = f"{kv_heads} heads" + (f" from head {first_head}" if first_head else "")
            raise ValueError(
                f"this scorer scores {self.layers} layers of {self.kv_heads} KV heads of {self.head_dim}; got layer "
                f"{layer_idx} of {heads} of {keys.shape[-1]}: train one for this model "
                "(keepkv.scorer_training.train_scorer)"
            )
        x = features(keys, values, self.features, positions, self.key.get("rope_theta"))
        tensors = self._on(keys.device)
        if kv_heads != self.kv_heads:  # every tensor is [L, H, ...]
            tensors = {name: t[:, first_head : first_head + kv_heads] for name, t in tensors.items()}
        # each row's layer's tensors [B, H, ...]: one gather each, by an index copied to the device (a
        # compression's; it reads the host anyway: keepkv.paged_slots)
        layer = torch.tensor(layer_idx, device=keys.device) if rows else layer_idx
        return self._predict(tensors, layer, x)

    def _predict(self, t: dict, layer, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, S, F] raw features of layer ``layer`` (an int; or an index [B] of each row's
        layer, or a slice of layers when x is [L', H, N, F]) -> predictions [B, H, S]."""
        x = (x - t["mean"][layer].unsqueeze(-2)) / t["std"][layer].unsqueeze(-2)
        out = (x * t["weight"][layer].unsqueeze(-2)).sum(-1) + t["bias"][layer][..., None]
        if self.kind == "mlp":
            hidden = torch.nn.functional.silu(x @ t["w1"][layer] + t["b1"][layer].unsqueeze(-2))
            out = out + (hidden * t["w2"][layer].unsqueeze(-2)).sum(-1)
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write the scorer to ``path`` (``torch.save``; a few hundred KB at most); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT, "kind": self.kind, "features": self.features, "key": dict(self.key),
                    "tensors": {name: t.detach().cpu().contiguous() for name, t in self.tensors.items()},
                    "report": dict(self.report), "layer_shares": dict(self.layer_shares)}, path)
        return path


def load_scorer(path: str | os.PathLike, config=None) -> Scorer:
    """The scorer saved at ``path``; with ``config`` (a model config or the model), ValueError in one
    line unless it was trained on a model of that config (:func:`config_key`)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no scorer file at {str(path)!r}: train one with `keepkv train-scorer --model MODEL --out FILE`")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        scorer = Scorer(saved["kind"], saved["features"], saved["key"], saved["tensors"], saved.get("report", {}),
                        saved.get("layer_shares", {}))
    except Exception as error:  # a truncated or foreign file, in one line
        raise ValueError(f"{str(path)!r} is no keepkv scorer file ({type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if config is not None:
        check_key(scorer.key, config_key(config), str(path))
    return scorer


def check_key(trained: dict, model: dict, where: str = "the scorer") -> None:
    """ValueError in one line naming the fields where a scorer's config key and a model's differ."""
    differ = [f"{name} {trained.get(name)!r} != {model.get(name)!r}" for name in KEY_FIELDS
              if trained.get(name) != model.get(name)]
    if differ:
        raise ValueError(f"{where} was trained on another model ({'; '.join(differ)}): train one for this model "
                         "with `keepkv train-scorer --model MODEL --out FILE` and pass scorer=FILE")


@functools.lru_cache(maxsize=8)
def _cached(path: str, stamp: int) -> Scorer:
    return load_scorer(path)


def cached_scorer(path: str | os.PathLike) -> Scorer:
    """The scorer at ``path``, read once per file version (a bounded cache: 8 files)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"no scorer file at {str(path)!r}: train one with `keepkv train-scorer --model MODEL --out FILE`")
    return _cached(str(path), path.stat().st_mtime_ns)


DEFAULTS = Path(__file__).resolve().parent / "scorers"  # the scorers keepkv ships, one file per model


def default_scorer() -> Path:
    """The path of the scorer shipped for the embedded model (SmolLM2-135M-Instruct)."""
    return DEFAULTS / "smollm2-135m-instruct.pt"


# -- fitting -----------------------------------------------------------------------------------
def spearman(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[...] Spearman rank correlation along the last axis of predicted, target [..., N] (ties
    ranked by position)."""
    ranks = [t.argsort(-1).argsort(-1).double() for t in (predicted, target)]
    ranks = [r - r.mean(-1, keepdim=True) for r in ranks]
    return (ranks[0] * ranks[1]).sum(-1) / (ranks[0].norm(dim=-1) * ranks[1].norm(dim=-1)).clamp_min(TINY)


def kept_overlap(predicted: torch.Tensor, target: torch.Tensor, share: float) -> torch.Tensor:
    """[...] share of the ``share`` x N entries of highest ``target`` [..., N] that the same number
    of highest ``predicted`` [..., N] also keeps."""
    count = max(1, round(share * predicted.shape[-1]))
    mine = torch.zeros_like(predicted, dtype=torch.bool).scatter_(-1, predicted.topk(count, -1).indices, True)
    theirs = torch.zeros_like(target, dtype=torch.bool).scatter_(-1, target.topk(count, -1).indices, True)
    return (mine & theirs).sum(-1).double() / count


class ScorerData:
    """Training pairs of a scorer, gathered document by document: for every layer and KV head, the
    sums of a ridge fit over every entry (float64), a sample of ``sample`` entries per document for
    the MLP, and the held-out documents whole, for :meth:`evaluate`.

    ``skip``: entries of the first ``skip`` positions (the sinks the selection always keeps) are
    left out of the fit and of the figures."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, features: str = "values+pairs",
                 sample: int = 256, skip: int = 4, seed: int = 0, key: dict | None = None):
        if features not in FEATURES:
            raise ValueError(f"features must be one of {', '.join(map(repr, FEATURES))}, got {features!r}")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.features, self.sample, self.skip = features, sample, skip
        self.key = key or {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
        if features in NEEDS_POSITIONS and self.key.get("rope_theta") is None:
            raise ValueError(f"features {features!r} un-rotate the keys: the key must name the model's rope_theta")
        width = FEATURES[features](head_dim) + 1  # the features and a constant 1
        self.gram = torch.zeros(layers, kv_heads, width, width, dtype=torch.float64)  # sum of [x 1]^T [x 1]
        self.cross = torch.zeros(layers, kv_heads, width, dtype=torch.float64)  # sum of [x 1] y
        self.square = torch.zeros(layers, kv_heads, dtype=torch.float64)  # sum of y^2
        self.samples_x: list[torch.Tensor] = []  # per document [L, H, n, F]
        self.samples_y: list[torch.Tensor] = []  # per document [L, H, n]
        self.held_out: list[tuple[torch.Tensor, torch.Tensor]] = []  # per document ([L, H, S, F], [L, H, S])
        self.documents = 0
        self.generator = torch.Generator().manual_seed(seed)

    def add(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor,
            held_out: bool = False) -> None:
        """One document: keys (after RoPE), values [L, H, S, D] of every layer, its KVzip scores
        [L, H, S] and its entries' positions [S]."""
        keep = positions >= self.skip
        x = features(keys[:, :, keep], values[:, :, keep], self.features, positions[keep],
                     self.key.get("rope_theta"))  # [L, H, S', F]
        y = log_targets(scores[:, :, keep])
        self.documents += 1
        if held_out:
            self.held_out.append((x, y))
            return
        ones = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1).double()
        self.gram += ones.transpose(-1, -2) @ ones
        self.cross += (ones * y.double()[..., None]).sum(-2)
        self.square += y.double().square().sum(-1)
        count = x.shape[2]
        pick = torch.randperm(count, generator=self.generator)[: self.sample].sort().values
        self.samples_x.append(x[:, :, pick])
        self.samples_y.append(y[:, :, pick])

    @property
    def entries(self) -> int:
        """Training entries per layer and head."""
        return int(self.gram[0, 0, -1, -1])

    def _standardisation(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean, std [L, H, F], covariance [L, H, F, F], covariance with y [L, H, F], mean of y [L, H])."""
        count = self.gram[..., -1, -1].clamp_min(1)[..., None]
        mean = self.gram[..., -1, :-1] / count
        y_mean = self.cross[..., -1] / count[..., 0]
        cov = self.gram[..., :-1, :-1] / count[..., None] - mean[..., :, None] * mean[..., None, :]
        cov_y = self.cross[..., :-1] / count - mean * y_mean[..., None]
        std = cov.diagonal(dim1=-2, dim2=-1).clamp_min(1e-12).sqrt()
        return mean, std, cov, cov_y, y_mean

    def fit(self, kind: str = "linear", ridge: float = 1e-3, hidden: int = 32, epochs: int = 30, lr: float = 3e-3,
            batch: int = 512, seed: int = 0, progress: bool = False) -> Scorer:
        """A :class:`Scorer` fitted to the training documents: closed-form ridge on the standardised
        features (penalty ``ridge`` times the count of entries), then, for ``kind="mlp"``, an MLP of
        ``hidden`` units on the ridge's residual, ``epochs`` of Adam over the sampled entries."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
        if self.entries == 0:
            raise ValueError("a scorer needs at least one training document with entries past the sinks")
        mean, std, cov, cov_y, y_mean = self._standardisation()
        corr = cov / (std[..., :, None] * std[..., None, :])
        eye = torch.eye(corr.shape[-1], dtype=corr.dtype)
        weight = torch.linalg.solve(corr + ridge * eye, (cov_y / std)[..., None])[..., 0]
        tensors = {"mean": mean.float(), "std": std.float(), "weight": weight.float(), "bias": y_mean.float()}
        if kind == "mlp":
            tensors.update(self._fit_mlp(tensors, hidden, epochs, lr, batch, seed, progress))
        return Scorer(kind, self.features, dict(self.key), tensors,
                      {"train_documents": self.documents - len(self.held_out), "train_entries": self.entries})

    def _fit_mlp(self, tensors, hidden, epochs, lr, batch, seed, progress) -> dict[str, torch.Tensor]:
        from tqdm.auto import tqdm

        x = torch.cat(self.samples_x, dim=2)  # [L, H, N, F]
        y = torch.cat(self.samples_y, dim=2)  # [L, H, N]
        x = (x - tensors["mean"][:, :, None]) / tensors["std"][:, :, None]
        residual = y - ((x * tensors["weight"][:, :, None]).sum(-1) + tensors["bias"][..., None])
        generator = torch.Generator().manual_seed(seed)
        layers, heads, count, width = x.shape
        w1 = (torch.randn(layers, heads, width, hidden, generator=generator) / math.sqrt(width)).requires_grad_()
        b1 = torch.zeros(layers, heads, 1, hidden, requires_grad=True)
        w2 = torch.zeros(layers, heads, hidden, requires_grad=True)  # starts as the ridge fit
        optimizer = torch.optim.Adam([w1, b1, w2], lr=lr)
        with torch.enable_grad():
            for _ in tqdm(range(epochs), desc="mlp", unit="epoch", leave=False, disable=not progress):
                for index in torch.randperm(count, generator=generator).split(batch):
                    hidden_out = torch.nn.functional.silu(x[:, :, index] @ w1 + b1)
                    loss = ((hidden_out * w2[:, :, None]).sum(-1) - residual[:, :, index]).square().mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
        return {"w1": w1.detach(), "b1": b1.detach()[:, :, 0], "w2": w2.detach()}

    def evaluate(self, scorer: Scorer, shares: tuple[float, ...] = (0.1, 0.2)) -> dict:
        """Figures of ``scorer`` on the held-out documents, means over documents, layers and heads:
        ``spearman`` (rank correlation with KVzip's scores), ``overlap@{share}`` (share of KVzip's
        kept set, at that budget, that the scorer's keeps), and ``spearman_worst_layer``."""
        if not self.held_out:
            return {}
        tensors = scorer._on("cpu")
        rho, overlaps = [], {share: [] for share in shares}
        for x, y in self.held_out:
            predicted = torch.stack([scorer._predict(tensors, layer, x[layer]) for layer in range(x.shape[0])])
            rho.append(spearman(predicted, y))  # [L, H]
            for share in shares:
                overlaps[share].append(kept_overlap(predicted, y, share))
        per_layer = torch.stack(rho).mean((0, 2))
        figures = {"heldout_documents": len(self.held_out), "spearman": float(per_layer.mean()),
                   "spearman_worst_layer": float(per_layer.min())}
        figures.update({f"overlap@{share}": float(torch.stack(o).mean()) for share, o in overlaps.items()})
        return figures
