"""``jsonl``, ``parquet``, ``dataset``: task sources that read prompts and answers from your files.

``jsonl`` reads a JSON-lines file (one object per line), ``parquet`` a Parquet file (pyarrow), and
``dataset`` a Hugging Face ``datasets`` directory written by ``save_to_disk`` (a ``Dataset``, or a
``DatasetDict`` and its ``split``). The kwargs are :class:`FileKwargs`; every file is read, and every
row checked, when the source is built, so a bad kwarg or a refused row stops the run before anything
starts (the CLI builds every domain's source first).

A row gives a :class:`~envs.base.Problem`: ``prompt`` = its ``prompt_key`` text, ``reference`` = its
``answer_key`` value (text, or a number written as text), ``system_prompt`` = its ``system_key`` text,
``prompt_id`` = ``"<path's stem>:<16 hex of sha256 of system and prompt>"`` (whatever the format).
``demonstration`` (the warm-up's target) is the row's ``solution_key`` text, else its answer. The
default verifier is ``math``; a domain's ``verifier`` picks another (``exact``, ``final_number``, ...).

Held-out split: the rows of ``eval_path`` (or ``eval_split``), else the rows whose prompt id hashes
(with ``seed``) below ``eval_fraction``, so the split depends on the content and the seed only, not on
row order. A training row whose prompt is held out is dropped (counted in :attr:`FileSource.notices`).

Bad rows (invalid JSON, not UTF-8, not an object, a missing key, an empty prompt or answer, a wrong
type) give one line each naming ``file:line`` (``file row N`` for Parquet and datasets, from 0):
``on_bad_row: refuse`` raises the first with the count, ``skip`` drops them, logs each and counts them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from envs.base import Problem, is_heldout_key
from envs.registry import register_source

log = logging.getLogger("rollstream.envs.files")

FORMATS = ("jsonl", "parquet", "dataset")
EXTRA = "pip install 'rollstream[data]'"
SHOWN_BAD_ROWS = 5
"""Bad rows shown one line each among :attr:`FileSource.notices` (the CLI prints them)."""
LOGGED_BAD_ROWS = 100
"""Bad rows logged one line each (the notices included); the rest are counted."""


class FileKwargs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The kwargs of a file task source (``data.domains[].kwargs``); docs/data.md shows them all."""

    path: Annotated[str, Meta(min_length=1)]
    """The file to train on (``dataset``: the directory ``save_to_disk`` wrote); relative to the
    directory ``rollstream`` runs in."""
    prompt_key: Annotated[str, Meta(min_length=1)] = "prompt"
    """The key (column) holding the prompt text."""
    answer_key: Annotated[str, Meta(min_length=1)] = "answer"
    """The key holding the reference answer the verifier compares with (text or a number)."""
    system_key: str = ""
    """The key holding a row's own system prompt (needs the chat template); empty = none. A row
    without it, or with null or "", gets the domain's system prompt."""
    solution_key: str = ""
    """The key holding a worked solution, the warm-up's target (``train.warmup_sft_steps``);
    empty, or a row without it = the answer."""
    eval_path: str = ""
    """A file (directory) of the same format holding the held-out rows; empty = ``eval_split``
    or ``eval_fraction``."""
    eval_fraction: Annotated[float, Meta(gt=0, lt=1)] | None = None
    """Share of the rows held out by a seeded hash of the prompt (default 0.1 without
    ``eval_path`` / ``eval_split``)."""
    seed: Annotated[int, Meta(ge=0)] = 0
    """Salt of the ``eval_fraction`` hash: another seed, another split."""
    split: str = ""
    """``dataset`` only: the split of a ``DatasetDict`` to train on (default ``train``, or its only
    split)."""
    eval_split: str = ""
    """``dataset`` only: the split of ``path`` held out (``test``); with ``eval_path``, the split
    of that directory (default ``test``, else ``validation``, else its only split)."""
    on_bad_row: Literal["skip", "refuse"] = "refuse"
    """A bad row (see docs/data.md): ``refuse`` stops the run naming it; ``skip`` drops it, logs
    one line for it and counts it."""


@dataclass(frozen=True)
class Row:
    """One good row of a file."""

    prompt: str
    answer: str
    system: str
    solution: str


class BadRows(list[str]):
    """One line per bad row, ``<where>: <what was wrong>``."""


# --------------------------------------------------------------------------- reading rows


def _text(value: Any, key: str, what: str) -> str | None:
    """``value`` as the text of a row's field, ``None`` when absent; ``ValueError`` when it is
    something else."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    raise ValueError(f"{what} key {key!r} is {type(value).__name__}, not text")


def _answer_text(value: Any, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"answer key {key!r} is {kind}, not text or a number")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"answer key {key!r} is {value}, not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


_MISSING = object()


def field_of(obj: dict[str, Any], key: str) -> Any:
    """``obj[key]``; a dotted key that is not a key itself walks nested objects
    (``reward_model.ground_truth``). :data:`_MISSING` when absent."""
    if key in obj:
        return obj[key]
    value: Any = obj
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _messages(value: list[Any], key: str) -> tuple[str, str]:
    """``(system, user)`` of a chat-message prompt: system messages, then one user message."""
    roles = [m.get("role") if isinstance(m, dict) else None for m in value]
    if (
        roles.count("user") != 1
        or any(r not in ("system", "user") for r in roles)
        or roles[-1] != "user"
        or not all(isinstance(m.get("content"), str) for m in value)
    ):
        raise ValueError(
            f"prompt key {key!r} is a list of messages with roles {roles}; "
            "one user message (after system messages) with text content is supported"
        )
    return "\n".join(m["content"] for m in value[:-1]), value[-1]["content"]


def parse_row(obj: dict[str, Any], k: FileKwargs) -> Row:
    """A good row from a decoded object, else ``ValueError`` saying what is wrong with it. A prompt
    may be text or chat messages (``[{"role": "system", ...}, {"role": "user", ...}]``)."""
    raw_prompt, raw_answer = field_of(obj, k.prompt_key), field_of(obj, k.answer_key)
    if raw_prompt is _MISSING:
        raise ValueError(f"missing key {k.prompt_key!r} (prompt_key)")
    if raw_answer is _MISSING:
        raise ValueError(f"missing key {k.answer_key!r} (answer_key)")
    system_of_prompt = ""
    if isinstance(raw_prompt, list):
        system_of_prompt, prompt = _messages(raw_prompt, k.prompt_key)
    else:
        prompt = _text(raw_prompt, k.prompt_key, "prompt") or ""
    if not prompt.strip():
        raise ValueError(f"empty prompt (key {k.prompt_key!r})")
    answer = _answer_text(raw_answer, k.answer_key)
    if not answer.strip():
        raise ValueError(f"empty answer (key {k.answer_key!r})")
    system = solution = None
    if k.system_key and (value := field_of(obj, k.system_key)) is not _MISSING:
        system = _text(value, k.system_key, "system")
    if k.solution_key and (value := field_of(obj, k.solution_key)) is not _MISSING:
        solution = _text(value, k.solution_key, "solution")
    return Row(prompt, answer, system or system_of_prompt, solution or answer)


def jsonl_objects(path: Path) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """``(where, object)`` for every non-blank line of a JSON-lines file, or ``(where, why)`` for a
    line that is not UTF-8, not JSON or not a JSON object. ``where`` is ``file:line``."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            if lineno == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield where, f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})"
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                yield where, f"invalid JSON: {e.msg} (column {e.colno})"
                continue
            if not isinstance(obj, dict):
                yield where, f"a JSON {type(obj).__name__}, not an object"
                continue
            yield where, obj


def _columns(k: FileKwargs) -> list[str]:
    return [c for c in (k.prompt_key, k.answer_key, k.system_key, k.solution_key) if c]


def _check_columns(names: list[str], k: FileKwargs, path: Path) -> list[str]:
    """The columns ``k`` reads (a dotted key reads its first part's column) that ``names`` has;
    ``ValueError`` naming a missing prompt or answer column."""

    def column(key: str) -> str:
        return key if key in names else key.split(".")[0]

    for key, name in (("prompt_key", k.prompt_key), ("answer_key", k.answer_key)):
        if column(name) not in names:
            raise ValueError(f"kwargs.{key}={name!r}: {path} has no such column; columns: {', '.join(names)}")
    return list(dict.fromkeys(column(c) for c in _columns(k) if column(c) in names))


def parquet_objects(path: Path, k: FileKwargs) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """``(file row N, row)`` of a Parquet file (``N`` from 0), only the columns ``k`` names."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"source 'parquet' needs pyarrow: {EXTRA}") from None
    try:
        names = pq.read_schema(path).names
    except Exception as e:
        raise ValueError(f"{path} cannot be read as Parquet: {_first_line(e)}") from None
    columns = _check_columns(names, k, path)
    try:
        table = pq.read_table(path, columns=columns)
    except Exception as e:
        raise ValueError(f"{path} cannot be read as Parquet: {_first_line(e)}") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _pick_split(obj: Any, wanted: str, defaults: tuple[str, ...], key: str, path: Path) -> Any:
    import datasets

    if isinstance(obj, datasets.Dataset):
        if wanted:
            raise ValueError(f"kwargs.{key}={wanted!r}: {path} is one Dataset, without splits; remove {key}")
        return obj
    splits = list(obj)
    if wanted:
        if wanted not in splits:
            raise ValueError(
                f"kwargs.{key}={wanted!r}: {path} has no such split; splits: {', '.join(splits)}"
            )
        return obj[wanted]
    for name in (*defaults, *(splits if len(splits) == 1 else ())):
        if name in splits:
            return obj[name]
    raise ValueError(f"kwargs.{key}: {path} holds the splits {', '.join(splits)}; name one")


def load_saved(path: Path) -> Any:
    """The ``Dataset`` or ``DatasetDict`` ``save_to_disk`` wrote at ``path``; ``ValueError`` when
    the ``datasets`` package is missing or ``path`` is no such directory."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"source 'dataset' needs the datasets package: {EXTRA}") from None
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:
        raise ValueError(f"{path} is not a directory written by save_to_disk: {_first_line(e)}") from None


def dataset_objects(ds: Any, path: Path, k: FileKwargs) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """``(file row N, row)`` of a loaded ``Dataset``, only the columns ``k`` names."""
    cols = _check_columns(list(ds.column_names), k, path)
    table = ds.select_columns(cols).with_format("arrow")[:]
    for i, row in enumerate(table.to_pylist()):
        yield f"{path} row {i}", row


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_rows(
    objects: Iterator[tuple[str, dict[str, Any] | str]], k: FileKwargs
) -> tuple[list[Row], BadRows]:
    """The good rows of ``objects`` and one line per bad one."""
    rows, bad = [], BadRows()
    for where, obj in objects:
        if isinstance(obj, str):
            bad.append(f"{where}: {obj}")
            continue
        try:
            rows.append(parse_row(obj, k))
        except ValueError as e:
            bad.append(f"{where}: {e}")
    return rows, bad


# --------------------------------------------------------------------------- the task source


def _digest(system: str, prompt: str) -> str:
    return hashlib.sha256(json.dumps([system, prompt]).encode()).hexdigest()[:16]


class FileSource:
    """Problems read from a file; see the module doc. Registered as ``jsonl``, ``parquet`` and
    ``dataset``."""

    default_verifier = "math"

    def __init__(
        self,
        name: str,
        kwargs: FileKwargs,
        train: list[Row],
        heldout: list[Row],
        bad: BadRows,
        notices: list[str],
    ) -> None:
        self.name, self.kwargs = name, kwargs
        self.prefix = Path(kwargs.path).stem or name
        """Of every prompt id: the name of ``path`` without its extension (``word_problems``)."""
        self.bad_rows = bad
        """One line per bad row skipped (``on_bad_row: skip``)."""
        self.notices = notices
        """Lines for the user: how many bad rows were skipped, how many training rows were dropped
        for being held out (the CLI prints them as warnings; every process logs them)."""
        held: dict[str, Problem] = {}
        for row in heldout:
            p = self._problem(row)
            held.setdefault(p.prompt_id, p)
        self._heldout = list(held.values())
        self._heldout_ids = frozenset(held)
        self._train: list[Problem] = []
        self._solutions: dict[tuple[str, str], str] = {}
        dropped = 0
        for row in train:
            p = self._problem(row)
            if p.prompt_id in held:
                dropped += 1
                continue
            self._train.append(p)
            self._solutions.setdefault((p.prompt_id, p.reference), row.solution)
        if dropped:
            self.notices.append(f"{kwargs.path}: {dropped} training rows dropped: their prompt is held out")
        if not self._train:
            raise ValueError(
                f"kwargs.path={kwargs.path!r}: no training rows left ({len(train)} good rows, "
                f"{len(bad)} bad, {dropped} held out)"
            )

    def _problem(self, row: Row) -> Problem:
        return Problem(
            prompt_id=f"{self.prefix}:{_digest(row.system, row.prompt)}",
            prompt=row.prompt,
            reference=row.answer,
            verifier=self.default_verifier,
            system_prompt=row.system,
        )

    @property
    def train_count(self) -> int:
        """How many training rows there are."""
        return len(self._train)

    @property
    def heldout_count(self) -> int:
        """How many distinct held-out prompts there are."""
        return len(self._heldout)

    def sample(self, rng: random.Random) -> Problem:
        """A training row, uniformly."""
        return self._train[rng.randrange(len(self._train))]

    def heldout(self, n: int) -> list[Problem]:
        """The first ``n`` distinct held-out prompts, in file order."""
        if n > len(self._heldout):
            how = (
                "eval_path / eval_split"
                if self.kwargs.eval_path or self.kwargs.eval_split
                else "eval_fraction"
            )
            raise ValueError(
                f"{n} held-out prompts asked, {len(self._heldout)} held out of {self.kwargs.path}; "
                f"lower data.heldout_size or hold out more ({how})"
            )
        return self._heldout[:n]

    def is_heldout(self, problem: Problem) -> bool:
        return problem.prompt_id in self._heldout_ids

    def demonstration(self, problem: Problem, rng: random.Random) -> str:
        """The row's worked solution (``solution_key``), else its answer."""
        return self._solutions.get((problem.prompt_id, problem.reference), problem.reference)


def _check_path(path: str, key: str, is_dir: bool) -> Path:
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"kwargs.{key}={path!r}: no such {'directory' if is_dir else 'file'} "
            f"(a relative path is read from {Path.cwd()})"
        )
    if is_dir and not p.is_dir():
        raise ValueError(
            f"kwargs.{key}={path!r} is a file; source 'dataset' reads a directory written by save_to_disk"
        )
    if not is_dir and p.is_dir():
        raise ValueError(f"kwargs.{key}={path!r} is a directory, not a file")
    return p


_MSGSPEC_PATH = re.compile(r" - at `\$\.([^`]*)`$")


def parse_kwargs(name: str, kwargs: dict[str, Any]) -> FileKwargs:
    """``kwargs`` as :class:`FileKwargs`, checked: a ``ValueError`` naming the key otherwise."""
    try:
        k = msgspec.convert(kwargs, FileKwargs)
    except msgspec.ValidationError as e:
        msg = str(e)
        unknown = re.match(r"Object contains unknown field `(.*)`", msg)
        if unknown:
            raise ValueError(
                f"unknown kwarg {unknown.group(1)!r}; kwargs: {', '.join(FileKwargs.__struct_fields__)}"
            ) from None
        if msg.startswith("Object missing required field `path`"):
            raise ValueError(
                f"kwargs.path is required (the {'directory' if name == 'dataset' else 'file'} to read)"
            ) from None
        at = _MSGSPEC_PATH.search(msg)
        if at is None:
            raise ValueError(msg) from None
        key = at.group(1).split(".")[0].split("[")[0]
        raise ValueError(f"kwargs.{at.group(1)}: {msg[: at.start()]}, got {kwargs.get(key)!r}") from None
    if k.eval_path and k.eval_fraction is not None:
        raise ValueError(
            "kwargs.eval_fraction: eval_path holds the held-out rows already; give one of the two"
        )
    if name != "dataset":
        for key in ("split", "eval_split"):
            if getattr(k, key):
                raise ValueError(f"kwargs.{key} is for source 'dataset' only (a {name} file has no splits)")
    elif k.eval_split and k.eval_fraction is not None:
        raise ValueError(
            "kwargs.eval_fraction: eval_split holds the held-out rows already; give one of the two"
        )
    return k


def _read(name: str, k: FileKwargs, path: Path, split: str, key: str) -> tuple[list[Row], BadRows]:
    if name == "jsonl":
        return read_rows(jsonl_objects(path), k)
    if name == "parquet":
        return read_rows(parquet_objects(path, k), k)
    ds = _pick_split(
        load_saved(path), split, ("train",) if key == "split" else ("test", "validation"), key, path
    )
    return read_rows(dataset_objects(ds, path, k), k)


def load_file_source(name: str, kwargs: dict[str, Any]) -> FileSource:
    """Read and check the files of a ``jsonl`` / ``parquet`` / ``dataset`` domain (module doc)."""
    k = parse_kwargs(name, kwargs)
    is_dir = name == "dataset"
    path = _check_path(k.path, "path", is_dir)
    rows, bad = _read(name, k, path, k.split, "split")
    if k.eval_path:
        eval_file = _check_path(k.eval_path, "eval_path", is_dir)
        heldout, eval_bad = _read(name, k, eval_file, k.eval_split, "eval_split")
        bad += eval_bad
        train = rows
    elif k.eval_split:
        heldout, eval_bad = _read(name, k, path, k.eval_split, "eval_split")
        bad += eval_bad
        train = rows
    else:
        fraction = 0.1 if k.eval_fraction is None else k.eval_fraction
        salt = f"files|{k.seed}"
        held = [is_heldout_key(salt, _digest(r.system, r.prompt), fraction) for r in rows]
        heldout = [r for r, h in zip(rows, held, strict=True) if h]
        train = [r for r, h in zip(rows, held, strict=True) if not h]
    if bad and k.on_bad_row == "refuse":
        raise ValueError(f"{bad[0]} ({len(bad)} bad rows in all; kwargs.on_bad_row: skip skips them)")
    notices = [f"skipped bad row {line}" for line in bad[:SHOWN_BAD_ROWS]]
    if bad:
        for line in bad[SHOWN_BAD_ROWS:LOGGED_BAD_ROWS]:
            log.warning("%s: skipped bad row %s", name, line)
        logged = (
            f", {min(len(bad), LOGGED_BAD_ROWS)} in the services' logs" if len(bad) > SHOWN_BAD_ROWS else ""
        )
        notices.append(f"{k.path}: {len(bad)} bad rows skipped (on_bad_row: skip){logged}")
    source = FileSource(name, k, train, heldout, bad, notices)
    for line in source.notices:
        log.warning("%s: %s", name, line)
    log.info(
        "%s: %s: %d training rows, %d held-out prompts",
        name,
        k.path,
        source.train_count,
        source.heldout_count,
    )
    return source


@register_source("jsonl")
def make_jsonl(**kwargs: Any) -> FileSource:
    """Prompts and answers from a JSON-lines file (see the module doc)."""
    return load_file_source("jsonl", kwargs)


@register_source("parquet")
def make_parquet(**kwargs: Any) -> FileSource:
    """Prompts and answers from a Parquet file (see the module doc)."""
    return load_file_source("parquet", kwargs)


@register_source("dataset")
def make_dataset(**kwargs: Any) -> FileSource:
    """Prompts and answers from a ``datasets`` directory written by ``save_to_disk``."""
    return load_file_source("dataset", kwargs)
