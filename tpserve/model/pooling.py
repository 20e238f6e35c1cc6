"""Pooling runners (``--runner pooling``): a decoder's final hidden states turned into one
embedding per prompt, as vLLM's embedding models and sentence-transformers compute them.

``PoolerConfig`` is resolved once at start-up (``resolve_pooler_config``): vLLM's defaults
for a decoder (``LAST`` token, L2-normalized), over them the checkpoint folder's
sentence-transformers files (``modules.json`` naming a ``Pooling`` module's folder and a
``Normalize`` module), over those ``--pooler-config``. What the engine then does per step
is ``pool_rows`` (which rows of the step's hidden states each pooled chunk contributes),
the runner sums them per chunk, and ``finish_embedding`` turns a prompt's pooled vector
into its answer (``dimensions`` cut, normalization); a classifier's answer is its head's
logits, which the HTTP routes turn into scores (``classification_scores``: vLLM's
activation for /classify, ``cross_encoder_score`` for /score and /rerank).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

RUNNERS = ("generate", "pooling")
RUNNER_CHOICES = ("auto", *RUNNERS)
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config keys -> our types; the other modes are refused
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
# llama.cpp's ``{arch}.pooling_type`` in GGUF files (0, none: per-token vectors, as if unset)
GGUF_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}
_GGUF_REFUSED = {4: "rank (a reranker's score head)"}
_ST_MODULES_KNOWN = ("sentence_transformers.models.Transformer",
                     "sentence_transformers.models.Pooling",
                     "sentence_transformers.models.Normalize")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """How a prompt's hidden states become its embedding: ``LAST`` (the last prompt
    token's), ``MEAN`` (the mean over every prompt token) or ``CLS`` (the first token's),
    of the final-normed hidden states; ``normalize``: L2-normalized (a request's
    ``normalize`` overrides it); ``source``: where the choice came from (start-up log)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    source: str = "vLLM's defaults for a decoder"
    # the vector's size (the model's hidden size) and the shorter sizes a request's
    # ``dimensions`` may ask (``ModelConfig.matryoshka_dimensions``: None none, () any)
    size: int = 0
    matryoshka: tuple[int, ...] | None = None
    # a sequence classifier's labels (``ModelConfig.labels``): the server classifies
    # (/classify; /score and /rerank as a cross-encoder) instead of embedding
    labels: tuple[str, ...] = ()
    # a classifier's ``problem_type`` (``ModelConfig.problem_type``; None: not given)
    problem_type: str | None = None

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}")

    @property
    def classifies(self) -> bool:
        return bool(self.labels)

    @property
    def routes(self) -> str:
        """The pooling routes this server answers (start-up log)."""
        if self.classifies:
            return "/classify, /score and /rerank"
        return "/v1/embeddings, /score and /rerank"

    @property
    def activation(self) -> str:
        """How /classify turns a classifier's logits into scores (vLLM's rule):
        ``identity`` (regression), ``sigmoid`` (one label, or each label of a multi-label
        classifier) or ``softmax``."""
        if self.problem_type == "regression":
            return "identity"
        if self.problem_type == "multi_label_classification" or len(self.labels) == 1:
            return "sigmoid"
        return "softmax"

    def describe(self) -> str:
        if self.classifies:
            how = self.activation
            if self.problem_type in ("regression", "multi_label_classification"):
                how += f", {self.problem_type}"
            return (f"a classifier of {len(self.labels)} label(s) ({', '.join(self.labels)}; "
                    f"{how}) over {self.pooling_type} pooling ({self.source})")
        return (f"{self.size}-dimensional embeddings, {self.pooling_type} pooling, "
                f"{'' if self.normalize else 'not '}normalized ({self.source})")

    def check_dimensions(self, dimensions: int | None) -> str | None:
        """Why a request's ``dimensions`` cannot be served (vLLM's rules), else None."""
        if dimensions is None:
            return None
        if self.matryoshka is None:
            return ("this model does not support Matryoshka representation (config.json "
                    "sets neither is_matryoshka nor matryoshka_dimensions): changing the "
                    "output dimensions would give poor embeddings")
        if dimensions < 1:
            return f"dimensions must be at least 1, got {dimensions}"
        if self.matryoshka and dimensions not in self.matryoshka:
            return (f"this model supports dimensions {list(self.matryoshka)} only, got "
                    f"{dimensions}")
        if dimensions > self.size:
            return f"dimensions must be at most the model's {self.size}, got {dimensions}"
        return None


def read_sentence_transformers(folder: Path | None) -> dict[str, Any] | None:
    """The pooling a sentence-transformers model folder declares (``pooling_type`` and
    ``normalize``), None when the folder has no ``modules.json``. A module that changes
    the vector after pooling (``Dense``, ...) or a pooling mode other than last token,
    mean or CLS is refused, naming it."""
    if folder is None or not (folder / "modules.json").is_file():
        return None
    modules = json.loads((folder / "modules.json").read_text())
    if not isinstance(modules, list):
        raise ValueError(f"{folder / 'modules.json'}: a list of modules is expected")
    found: dict[str, Any] = {"normalize": False}
    for m in modules:
        kind = m.get("type", "")
        if kind not in _ST_MODULES_KNOWN:
            raise ValueError(f"{folder / 'modules.json'}: module {m.get('name')!r} of type "
                             f"{kind!r} is not supported (only Transformer, Pooling and "
                             "Normalize modules are)")
        if kind.endswith(".Normalize"):
            found["normalize"] = True
        elif kind.endswith(".Pooling"):
            path = folder / m.get("path", "") / "config.json"
            if not path.is_file():
                raise ValueError(f"{folder / 'modules.json'}: the Pooling module's "
                                 f"{path} is missing")
            cfg = json.loads(path.read_text())
            other = [k for k in _ST_OTHER_MODES if cfg.get(k)]
            modes = [k for k in _ST_MODES if cfg.get(k)]
            if other or len(modes) != 1:
                raise ValueError(f"{path}: exactly one of {', '.join(_ST_MODES)} must be set "
                                 f"(got {', '.join(other + modes) or 'none'}); "
                                 "--pooler-config chooses the pooling instead")
            if cfg.get("include_prompt", True) is False:
                raise ValueError(f"{path}: include_prompt false (an instruction left out of "
                                 "the pooling) is not supported")
            found["pooling_type"] = _ST_MODES[modes[0]]
    return found


def read_gguf_pooling(code: int | None, name: str) -> dict[str, Any] | None:
    """The pooling a GGUF file declares (llama.cpp's ``pooling_type``; normalization is
    not stored there: llama.cpp normalizes by default, so ``normalize`` stays the
    default), None when it declares none."""
    if code is None or code == 0:
        return None
    if code in _GGUF_REFUSED:
        raise ValueError(f"{name}: pooling_type {code} ({_GGUF_REFUSED[code]}) is not "
                         "supported")
    if code not in GGUF_POOLING_TYPES:
        raise ValueError(f"{name}: unknown pooling_type {code}")
    return {"pooling_type": GGUF_POOLING_TYPES[code]}


def parse_pooler_config(text: str | None) -> dict[str, Any]:
    """``--pooler-config``: a JSON object of ``pooling_type`` (LAST, MEAN or CLS, any case)
    and ``normalize``; any other key is refused by name."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--pooler-config: not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("--pooler-config: a JSON object is expected")
    unknown = sorted(set(value) - set(POOLER_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--pooler-config: {', '.join(unknown)} not supported (keys: "
                         f"{', '.join(POOLER_CONFIG_KEYS)})")
    if "pooling_type" in value:
        if not isinstance(value["pooling_type"], str):
            raise ValueError("--pooler-config: pooling_type must be a string")
        value["pooling_type"] = value["pooling_type"].upper()
        if value["pooling_type"] not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {value['pooling_type']!r}")
    if "normalize" in value and not isinstance(value["normalize"], bool):
        raise ValueError("--pooler-config: normalize must be true or false")
    return value


def resolve_pooler_config(flag: str | None, declared: tuple[dict[str, Any], str] | None,
                          size: int, matryoshka: tuple[int, ...] | None,
                          labels: tuple[str, ...] = (),
                          problem_type: str | None = None) -> PoolerConfig:
    """The pooling of a ``--runner pooling`` server: defaults, then what the checkpoint
    declares (``declared``: its values and where they come from, ``Checkpoint.pooling``),
    then ``--pooler-config`` (``flag``), each over the last; ``size``, ``matryoshka``,
    ``labels`` and ``problem_type`` are the model's (``ModelConfig``). A classifier's
    defaults are vLLM's: the last token's hidden state, unnormalized (the head takes it as
    transformers does)."""
    values: dict[str, Any] = {"size": size, "matryoshka": matryoshka, "labels": labels}
    if labels:
        values["normalize"] = False
        values["problem_type"] = problem_type
    sources = []
    if declared is not None:
        values.update(declared[0])
        sources.append(declared[1])
    override = parse_pooler_config(flag)
    if override:
        values.update(override)
        sources.append("--pooler-config")
    return PoolerConfig(**values, **({"source": " and ".join(sources)} if sources else {}))


def resolve_runner(flag: str, classifier: bool = False) -> str:
    """``--runner auto`` is ``generate``: tpserve's architectures are decoders, which vLLM
    also runs generatively unless told ``--runner pooling``; a sequence classifier
    (``classifier``: it has no LM head) is ``pooling``, and refuses ``generate``."""
    if flag not in RUNNER_CHOICES:
        raise ValueError(f"--runner must be one of {', '.join(RUNNER_CHOICES)}, got {flag!r}")
    if classifier:
        if flag == "generate":
            raise ValueError("--runner generate: this checkpoint is a sequence classifier "
                             "(no LM head); serve it with --runner pooling (or auto)")
        return "pooling"
    return "generate" if flag == "auto" else flag


@dataclass(frozen=True)
class PoolRows:
    """Rank 0's pooling work in one step: ``rows`` of the step's hidden states, each added
    into output row ``segments[i]`` of a ``[count, hidden]`` float32 sum."""

    rows: torch.Tensor      # int64 [Q]
    segments: torch.Tensor  # int64 [Q]
    count: int


def pool_rows(chunks: list[tuple[int, int, int, bool, str]]) -> tuple[PoolRows, list[int]]:
    """``chunks``: per pooled chunk of a step ``(first row in the step, rows, first
    position, final, pooling type)``. Returns the rows to sum and, per chunk, its output
    row (-1 where the chunk contributes none: LAST before the final chunk, CLS after the
    first)."""
    rows: list[int] = []
    segments: list[int] = []
    out: list[int] = []
    count = 0
    for first, n, start, final, kind in chunks:
        if kind == "LAST":
            take = [first + n - 1] if final else []
        elif kind == "CLS":
            take = [first] if start == 0 else []
        else:
            take = list(range(first, first + n))
        out.append(count if take else -1)
        if take:
            rows.extend(take)
            segments.extend([count] * len(take))
            count += 1
    i64 = torch.int64
    return PoolRows(torch.tensor(rows, dtype=i64), torch.tensor(segments, dtype=i64),
                    count), out


def sum_rows(hidden: torch.Tensor, pool: PoolRows) -> torch.Tensor:
    """``[count, hidden]`` float32: each output row the sum of its hidden rows."""
    rows = pool.rows.to(hidden.device, non_blocking=True)
    segments = pool.segments.to(hidden.device, non_blocking=True)
    out = torch.zeros(pool.count, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, segments, hidden.index_select(0, rows).float())


def pooled_vector(pooled: torch.Tensor, num_tokens: int, pooling_type: str) -> torch.Tensor:
    """A prompt's pooled vector from its summed rows: the mean for ``MEAN`` (the sum over
    its ``num_tokens`` rows), the one row's for ``LAST`` and ``CLS``."""
    return pooled / num_tokens if pooling_type == "MEAN" else pooled


def finish_embedding(pooled: torch.Tensor, num_tokens: int, pooling_type: str,
                     normalize: bool, dimensions: int | None) -> list[float]:
    """A prompt's embedding from its pooled float32 vector (a MEAN's sum over its
    ``num_tokens`` rows): the first ``dimensions`` entries (Matryoshka), then L2-normalized
    if ``normalize`` (as sentence-transformers cuts, then normalizes)."""
    v = pooled_vector(pooled, num_tokens, pooling_type)
    if dimensions is not None:
        v = v[:dimensions]
    if normalize:
        v = torch.nn.functional.normalize(v, p=2.0, dim=0)
    return v.tolist()


def classifier_head(model: Any) -> torch.Tensor | None:
    """A float32 host copy of ``model``'s classifier head (``[labels, hidden]``), for rank
    0's engine to apply to pooled rows; None for a model without one."""
    score = getattr(model, "score", None)
    return None if score is None else score.weight.detach().float().cpu()


def finish_classification(pooled: torch.Tensor, num_tokens: int, pooling_type: str,
                          head: torch.Tensor) -> list[float]:
    """A prompt's logits from its pooled float32 vector: the head's (float32), one per
    label; the route applies the activation (``classification_scores``,
    ``cross_encoder_score``), which a request may switch off (``use_activation``)."""
    v = pooled_vector(pooled, num_tokens, pooling_type)
    return (head @ v.to(head.device, torch.float32)).tolist()


def classification_scores(logits: list[float], activation: str) -> list[float]:
    """/classify's scores of a classifier's float32 ``logits``, by ``activation``
    (``PoolerConfig.activation``; vLLM's ``get_classification_act_fn``): ``identity``
    (a regressor's raw scores), ``sigmoid`` (each label's own) or ``softmax``."""
    if activation == "identity":
        return list(logits)
    t = torch.tensor(logits, dtype=torch.float32)
    return (torch.sigmoid(t) if activation == "sigmoid" else torch.softmax(t, -1)).tolist()


def cross_encoder_score(logit: float) -> float:
    """/score's and /rerank's score of a one-label classifier's logit (vLLM's
    ``get_cross_encoder_act_fn`` for a checkpoint naming no activation: the sigmoid,
    whatever its ``problem_type``)."""
    return torch.sigmoid(torch.tensor(logit, dtype=torch.float32)).item()
