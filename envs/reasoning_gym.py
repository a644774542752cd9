"""``reasoning_gym``: task source and verifier over the procedural generators of reasoning-gym.

Source kwargs (``DomainConfig.kwargs``): ``dataset`` (required), ``seed`` (default 0),
``heldout_size_max`` (default 256), ``chunk_size`` (default 100_000) and ``train_chunks``
(default 10); every other kwarg goes to the generator's config dataclass (a name it lacks, or
``size``, is a one-line ``ValueError``).

The held-out split is the first ``heldout_size_max`` entries of the generator seeded ``seed``;
training entries come from ``train_chunks`` generators of ``chunk_size`` entries with other seeds,
and an entry whose question is a held-out one is redrawn. ``prompt`` is the entry's question;
``prompt_id`` is ``"<dataset>:<first 16 hex of sha256(question)>"``; ``reference`` is the JSON
object ``{"dataset", "answer", "metadata", "config"}`` (values JSON lacks are encoded reversibly by
:func:`to_json_safe`). ``demonstration`` is the entry's answer (``ValueError`` for datasets without
one). Generators that depend on ``PYTHONHASHSEED`` (:data:`HASH_SEED_DEPENDENT`) warn unless it is
fixed.

Verifier ``reasoning_gym``: rebuilds the dataset's scorer from the reference's config (cached) and
calls its ``score_answer``: ``reward`` is the score (partial credit possible), ``correct`` is
``score == 1.0``. reasoning-gym is imported on first use (~2 s): with ``isolation="process"``,
call :func:`preload` in the parent once. Measured costs and caveats: docs/rewards.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import random
import threading
import warnings
from functools import lru_cache
from typing import Any

from envs.base import Problem, VerifyResult
from envs.registry import register_source, register_verifier

_OWN_KWARGS = ("dataset", "seed", "heldout_size_max", "chunk_size", "train_chunks")
_MAX_ATTEMPTS = 1000
# Generators whose output depends on PYTHONHASHSEED (measured with reasoning-gym 0.1.25: the same
# seed gives other questions in another process), so their split is only stable across processes
# when PYTHONHASHSEED is fixed.
HASH_SEED_DEPENDENT = frozenset({
    "codeio", "isomorphic_strings", "knight_swap", "list_functions", "polynomial_multiplication",
    "ransom_note", "word_ladder",
})

# --------------------------------------------------------------------------- JSON-safe values

_TAGS = ("__tuple__", "__set__", "__frozenset__", "__dict__", "__float__", "__repr__")


def to_json_safe(obj: Any) -> Any:
    """``obj`` as plain JSON values, reversibly for what reasoning-gym metadata holds: a tuple
    becomes ``{"__tuple__": [...]}``, a set ``{"__set__": [...]}`` (frozenset alike), a dict with
    non-string keys ``{"__dict__": [[k, v], ...]}``, a non-finite float ``{"__float__": "nan"}``,
    a numpy scalar/array its ``item()``/``tolist()``; anything else ``{"__repr__": repr(obj)}``.
    :func:`from_json_safe` inverts it (``__repr__`` decodes to the repr string)."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, list):
        return [to_json_safe(v) for v in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json_safe(v) for v in obj]}
    if isinstance(obj, (set, frozenset)):
        tag = "__set__" if isinstance(obj, set) else "__frozenset__"
        return {tag: sorted((to_json_safe(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in _TAGS):
            return {k: to_json_safe(v) for k, v in obj.items()}
        return {"__dict__": [[to_json_safe(k), to_json_safe(v)] for k, v in obj.items()]}
    if type(obj).__module__ == "numpy":
        if hasattr(obj, "tolist"):
            return to_json_safe(obj.tolist())
    return {"__repr__": repr(obj)}


def from_json_safe(obj: Any) -> Any:
    """The inverse of :func:`to_json_safe`."""
    if isinstance(obj, list):
        return [from_json_safe(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        (tag, value), = obj.items()
        if tag == "__tuple__":
            return tuple(from_json_safe(v) for v in value)
        if tag == "__set__":
            return {from_json_safe(v) for v in value}
        if tag == "__frozenset__":
            return frozenset(from_json_safe(v) for v in value)
        if tag == "__dict__":
            return {from_json_safe(k): from_json_safe(v) for k, v in value}
        if tag == "__float__":
            return float(value)
        if tag == "__repr__":
            return value
    return {k: from_json_safe(v) for k, v in obj.items()}


# --------------------------------------------------------------------------- reasoning-gym access


def _datasets() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ValueError(f"reasoning_gym: the reasoning-gym package is not installed ({e})") from None
    return DATASETS


def _create(dataset: str, config: dict[str, Any], seed: int, size: int) -> Any:
    """A reasoning-gym generator instance (``seed`` taken modulo 2**32)."""
    dataset_cls, config_cls = _datasets()[dataset]
    cfg = config_cls(**config, seed=seed % 2**32, size=size)
    return dataset_cls(config=cfg)  # validates the config


def check_dataset(dataset: Any) -> str:
    """``dataset`` if it names a reasoning-gym dataset this source supports, else ``ValueError``."""
    if not isinstance(dataset, str) or not dataset:
        raise ValueError("reasoning_gym: kwarg 'dataset' is required (a reasoning-gym dataset name, e.g. 'chain_sum')")
    names = _datasets()
    if dataset == "composite":
        raise ValueError("reasoning_gym: dataset 'composite' is not supported; use one domain per dataset with ratios")
    if dataset not in names:
        close = difflib.get_close_matches(dataset, list(names), n=5, cutoff=0.5)
        hint = f"close names: {', '.join(close)}" if close else f"{len(names)} datasets, e.g. {', '.join(sorted(names)[:5])}"
        raise ValueError(f"reasoning_gym: unknown dataset {dataset!r}; {hint}")
    return dataset


def check_config(dataset: str, config: dict[str, Any], sizes: tuple[int, ...] = (1,)) -> None:
    """``ValueError`` (one line) unless the generator accepts ``config`` (its config class
    validates it for each size of ``sizes``, and an instance of size 1 builds)."""
    _, config_cls = _datasets()[dataset]
    allowed = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(config) - allowed)
    if unknown:
        raise ValueError(
            f"reasoning_gym({dataset}): unknown kwargs {unknown}; generator kwargs: {sorted(allowed)}; "
            f"source kwargs: {list(_OWN_KWARGS)}"
        )
    try:
        for size in sizes:
            cfg = config_cls(**config, seed=0, size=size)
            if callable(getattr(cfg, "validate", None)):
                cfg.validate()
        _create(dataset, config, seed=0, size=1)
    except Exception as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"reasoning_gym({dataset}): generator rejected kwargs {config}: {msg}") from None


@lru_cache(maxsize=256)
def _scorer(dataset: str, config_json: str) -> Any:
    config = from_json_safe(json.loads(config_json))
    return _create(dataset, config, seed=0, size=1).score_answer


def preload(dataset: str | None = None, config: dict[str, Any] | None = None) -> None:
    """Import reasoning-gym (and build ``dataset``'s scorer) now, e.g. before forking verifier
    processes."""
    _datasets()
    if dataset:
        _scorer(dataset, json.dumps(to_json_safe(config or {}), sort_keys=True))


def _digest(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()


# --------------------------------------------------------------------------- the task source


class ReasoningGymSource:
    """Problems of one reasoning-gym dataset; see the module doc. Registered as ``reasoning_gym``."""

    name = "reasoning_gym"
    default_verifier = "reasoning_gym"

    def __init__(
        self,
        dataset: str,
        config: dict[str, Any] | None = None,
        *,
        seed: int = 0,
        heldout_size_max: int = 256,
        chunk_size: int = 100_000,
        train_chunks: int = 10,
    ) -> None:
        self.dataset = check_dataset(dataset)
        for key, value, low in (("seed", seed, 0), ("heldout_size_max", heldout_size_max, 0),
                                ("chunk_size", chunk_size, 1), ("train_chunks", train_chunks, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"reasoning_gym({dataset}): {key}={value!r} must be an integer >= {low}")
        if self.dataset in HASH_SEED_DEPENDENT and os.environ.get("PYTHONHASHSEED", "random") == "random":
            warnings.warn(
                f"reasoning_gym({dataset}): this generator depends on PYTHONHASHSEED; set it (e.g. 0) in "
                "every process, or processes disagree on the problems and the held-out split",
                stacklevel=2,
            )
        self.config = dict(config or {})
        check_config(self.dataset, self.config, sizes=(chunk_size, max(1, heldout_size_max)))
        self.seed = seed
        self.heldout_size_max = heldout_size_max
        self.chunk_size = chunk_size
        self.train_chunks = train_chunks
        self._config_safe = to_json_safe(self.config)
        self._lock = threading.Lock()
        self._heldout: list[Problem] | None = None
        self._heldout_digests: frozenset[str] = frozenset()
        self._chunks: dict[int, Any] = {}

    # ------------------------------------------------------------------ entries -> problems

    def problem(self, entry: dict[str, Any]) -> Problem:
        """The problem of a reasoning-gym entry (``question``, ``answer``, ``metadata``)."""
        question = entry["question"]
        answer = entry.get("answer")
        reference = {
            "dataset": self.dataset,
            "answer": answer if answer is None or isinstance(answer, str) else str(answer),
            "metadata": to_json_safe(entry.get("metadata") or {}),
            "config": self._config_safe,
        }
        return Problem(
            prompt_id=f"{self.dataset}:{_digest(question)[:16]}",
            prompt=question,
            reference=json.dumps(reference, ensure_ascii=False, separators=(",", ":")),
            verifier=self.default_verifier,
        )

    def _ensure_heldout(self) -> list[Problem]:
        with self._lock:
            if self._heldout is None:
                problems: dict[str, Problem] = {}
                if self.heldout_size_max:
                    ds = _create(self.dataset, self.config, seed=self.seed, size=self.heldout_size_max)
                    for idx in range(self.heldout_size_max):
                        try:
                            entry = ds[idx]
                        except Exception:
                            continue
                        problems.setdefault(_digest(entry["question"]), self.problem(entry))
                self._heldout = list(problems.values())
                self._heldout_digests = frozenset(problems)
            return self._heldout

    def _chunk(self, c: int) -> Any:
        ds = self._chunks.get(c)
        if ds is None:
            seed = self.seed + self.heldout_size_max + c * self.chunk_size
            ds = self._chunks.setdefault(c, _create(self.dataset, self.config, seed=seed, size=self.chunk_size))
        return ds

    # ------------------------------------------------------------------ TaskSource

    def sample(self, rng: random.Random) -> Problem:
        """A training problem: a uniform (chunk, index) of the training pool, redrawn while its
        question is a held-out question or its generation raises."""
        self._ensure_heldout()
        last_error = ""
        for _ in range(_MAX_ATTEMPTS):
            c, idx = rng.randrange(self.train_chunks), rng.randrange(self.chunk_size)
            try:
                entry = self._chunk(c)[idx]
            except Exception as e:
                last_error = f"; last generator error: {type(e).__name__}: {e}"
                continue
            if _digest(entry["question"]) not in self._heldout_digests:
                return self.problem(entry)
        raise RuntimeError(
            f"reasoning_gym({self.dataset}): no training problem in {_MAX_ATTEMPTS} draws (the held-out "
            f"split covers the problem space? lower heldout_size_max or widen the generator config){last_error}"
        )

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` distinct held-out problems (same for the same kwargs)."""
        problems = self._ensure_heldout()
        if n > len(problems):
            raise ValueError(
                f"reasoning_gym({self.dataset}): {n} held-out problems asked, {len(problems)} available "
                f"(distinct questions among heldout_size_max={self.heldout_size_max}); raise heldout_size_max"
            )
        return problems[:n]

    @property
    def heldout_count(self) -> int:
        """How many distinct held-out problems there are (at most ``heldout_size_max``)."""
        return len(self._ensure_heldout())

    def is_heldout(self, problem: Problem) -> bool:
        self._ensure_heldout()
        return _digest(problem.prompt) in self._heldout_digests

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The entry's reference answer, bare."""
        answer = json.loads(problem.reference).get("answer")
        if not isinstance(answer, str):
            raise ValueError(
                f"reasoning_gym({self.dataset}): problem {problem.prompt_id} has no reference answer to "
                "demonstrate (the dataset accepts many answers)"
            )
        return answer


@register_source("reasoning_gym")
def make_reasoning_gym(**kwargs: Any) -> ReasoningGymSource:
    """Build a :class:`ReasoningGymSource` from domain kwargs: the source's own kwargs (see the
    module doc) and the generator's config kwargs."""
    own = {k: kwargs.pop(k) for k in _OWN_KWARGS if k in kwargs}
    dataset = own.pop("dataset", None)
    return ReasoningGymSource(dataset, kwargs, **own)


# --------------------------------------------------------------------------- the verifier


@register_verifier("reasoning_gym")
def reasoning_gym_verifier(response: str, reference: str, **kwargs: Any) -> VerifyResult:
    """Score ``response`` with the reference dataset's own ``score_answer`` (see the module doc)."""
    ref = json.loads(reference)
    dataset = ref["dataset"]
    score_answer = _scorer(dataset, json.dumps(ref.get("config") or {}, sort_keys=True))
    entry = {"answer": ref.get("answer"), "metadata": from_json_safe(ref.get("metadata") or {})}
    score = min(1.0, max(0.0, float(score_answer(response, entry))))
    ok = score == 1.0
    want = entry["answer"]
    details = f"{dataset}: score {score:g}, got {response[:80]!r}" + (f", want {want[:80]!r}" if isinstance(want, str) else "")
    return VerifyResult(reward=score, correct=ok, details=details, components={"correct": float(ok)})
