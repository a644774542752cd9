"""The file task sources (``jsonl``, ``parquet``, ``dataset``): every format gives the same problems,
the held-out split is deterministic and disjoint, each kind of bad row is named by ``file:line`` and
skipped with a count or refused, the kwargs are checked in one line, and examples/my_data.yaml
resolves to the shipped data and learns from what it can score."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

import envs
from cli.run import check_domains
from envs.files import FileKwargs
from schemas.config import ConfigError, parse_config
from services.trainer.warmup import format_answer

ROOT = Path(__file__).resolve().parents[2]

ROWS: list[dict[str, Any]] = [
    {
        "q": "Ann has 3 pens and gets 4 more. How many now?",
        "a": "7",
        "sys": "Answer with a number.",
        "sol": "3+4;7",
    },
    {"q": "Ben had 9 cups and lost 2. How many are left?", "a": 7},
    {"q": "What is half of 5?", "a": 2.5},
    {"q": "What is 6 times 7?", "a": 42.0, "sys": None},
] + [{"q": f"What is {i} plus {i}?", "a": str(2 * i)} for i in range(40)]
KEYS = {"prompt_key": "q", "answer_key": "a", "system_key": "sys", "solution_key": "sol"}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def as_tuples(problems: list[envs.Problem]) -> list[tuple[str, str, str]]:
    return [(p.prompt, p.reference, p.system_prompt) for p in problems]


def test_a_jsonl_row_becomes_a_problem_with_its_system_prompt_and_solution(tmp_path: Path) -> None:
    src = envs.make_source(
        "jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), eval_fraction=0.2, **KEYS
    )
    assert src.bad_rows == [] and src.notices == []
    problems = {
        p.prompt: p
        for p in (*src.heldout(src.heldout_count), *(src.sample(random.Random(i)) for i in range(500)))
    }
    assert len(problems) == len(ROWS)
    first = problems[ROWS[0]["q"]]
    assert (first.reference, first.system_prompt, first.verifier) == ("7", "Answer with a number.", "math")
    assert first.prompt_id.startswith("d:") and len(first.prompt_id) == len("d:") + 16  # the file's stem
    assert src.demonstration(first, random.Random(0)) == "3+4;7"
    no_solution = problems[ROWS[1]["q"]]
    assert (no_solution.reference, no_solution.system_prompt) == ("7", "")  # a number as text
    assert src.demonstration(no_solution, random.Random(0)) == "7"  # the answer when no solution
    assert problems[ROWS[2]["q"]].reference == "2.5" and problems[ROWS[3]["q"]].reference == "42"


@pytest.mark.parametrize("answer", ["raw", "tag", "boxed", "auto"])
def test_file_problems_score_in_every_answer_format_with_the_default_verifier(
    tmp_path: Path, answer: str
) -> None:
    src = envs.make_source("jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)), **KEYS)
    for p in [*src.heldout(3), src.sample(random.Random(0))]:
        demo = format_answer(src.demonstration(p, random.Random(0)), answer)
        assert envs.score_response(
            src.default_verifier, demo, p.reference, answer=answer, isolation="inline"
        ).correct
        wrong = format_answer("-1", answer)
        assert not envs.score_response(
            src.default_verifier, wrong, p.reference, answer=answer, isolation="inline"
        ).correct


def test_chat_message_prompts_and_nested_keys_as_verl_writes_them(tmp_path: Path) -> None:
    rows = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}],
            "reward_model": {"ground_truth": "2"},
        },
        {
            "prompt": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
            "reward_model": {"ground_truth": "4"},
        },
        {"prompt": [{"role": "user", "content": "3+3?"}], "reward_model": {"ground_truth": 6}},
    ]
    src = envs.make_source(
        "jsonl",
        path=str(write_jsonl(tmp_path / "v.jsonl", rows)),
        answer_key="reward_model.ground_truth",
        eval_path=str(write_jsonl(tmp_path / "e.jsonl", rows[:1])),
        on_bad_row="skip",
    )
    assert as_tuples(src.heldout(1)) == [("1+1?", "2", "Be brief.")]
    assert as_tuples([src.sample(random.Random(0))]) == [("3+3?", "6", "")] and src.train_count == 1
    assert src.bad_rows == [
        f"{tmp_path / 'v.jsonl'}:2: prompt key 'prompt' is a list of messages with roles "
        "['user', 'assistant']; one user message (after system messages) with text content is supported"
    ]


def test_parquet_and_a_saved_dataset_give_the_same_problems_as_jsonl(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([{**r, "a": str(r["a"]), "extra": 1} for r in ROWS])  # one type per column
    pq.write_table(table, tmp_path / "d.parquet")
    datasets.Dataset(table).save_to_disk(str(tmp_path / "ds"))
    train, test = datasets.Dataset(table.slice(0, 30)), datasets.Dataset(table.slice(30))
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(tmp_path / "dd"))
    jsonl_rows = [{**r, "a": str(r["a"])} for r in ROWS]
    want = envs.make_source("jsonl", path=str(write_jsonl(tmp_path / "d.jsonl", jsonl_rows)), **KEYS)
    for name, path in (("parquet", tmp_path / "d.parquet"), ("dataset", tmp_path / "ds")):
        got = envs.make_source(name, path=str(path), **KEYS)
        assert as_tuples(got.heldout(got.heldout_count)) == as_tuples(want.heldout(want.heldout_count)), name
        assert got.train_count == want.train_count, name
        assert as_tuples([got.sample(random.Random(7))]) == as_tuples([want.sample(random.Random(7))]), name
    split = envs.make_source(
        "dataset", path=str(tmp_path / "dd"), eval_split="test", **KEYS
    )  # trains on train
    assert (split.train_count, split.heldout_count) == (30, len(ROWS) - 30)
    assert split.heldout(1)[0].prompt == ROWS[30]["q"]
    with pytest.raises(ValueError, match=r"kwargs.split='dev': .* has no such split; splits: train, test$"):
        envs.make_source("dataset", path=str(tmp_path / "dd"), split="dev", **KEYS)
    with pytest.raises(
        ValueError, match=r"kwargs.answer_key='answer': .*d.parquet has no such column; columns: q, a, "
    ):
        envs.make_source("parquet", path=str(tmp_path / "d.parquet"), prompt_key="q")


def test_the_held_out_split_is_deterministic_by_seed_and_content(tmp_path: Path) -> None:
    path = str(write_jsonl(tmp_path / "d.jsonl", ROWS))
    shuffled = str(write_jsonl(tmp_path / "s.jsonl", random.Random(3).sample(ROWS, len(ROWS))))

    def split(p: str, seed: int) -> set[str]:
        src = envs.make_source("jsonl", path=p, eval_fraction=0.3, seed=seed, **KEYS)
        held = {q.prompt for q in src.heldout(src.heldout_count)}
        trained = {src.sample(random.Random(i)).prompt for i in range(400)}
        assert not held & trained and len(held) + src.train_count == len(ROWS)
        return held

    first = split(path, 0)
    assert 0 < len(first) < len(ROWS) and split(path, 0) == first == split(shuffled, 0)  # not by row order
    assert split(path, 1) != first


def test_rows_of_the_eval_file_are_held_out_and_dropped_from_training(tmp_path: Path) -> None:
    src = envs.make_source(
        "jsonl",
        path=str(write_jsonl(tmp_path / "d.jsonl", ROWS)),
        **KEYS,
        eval_path=str(write_jsonl(tmp_path / "e.jsonl", ROWS[:5])),
    )
    assert as_tuples(src.heldout(5))[0] == (ROWS[0]["q"], "7", "Answer with a number.")
    assert src.train_count == len(ROWS) - 5 and all(src.is_heldout(p) for p in src.heldout(5))
    assert src.notices == [f"{tmp_path / 'd.jsonl'}: 5 training rows dropped: their prompt is held out"]
    with pytest.raises(
        ValueError, match=r"^6 held-out prompts asked, 5 held out of .*; lower data.heldout_size"
    ):
        src.heldout(6)


BAD_LINES: list[tuple[bytes, str]] = [
    (b'{"q": "1+1?"}', "missing key 'a' (answer_key)"),
    (b'{"a": "2"}', "missing key 'q' (prompt_key)"),
    (b'{"q": "  ", "a": "2"}', "empty prompt (key 'q')"),
    (b'{"q": "1+1?", "a": ""}', "empty answer (key 'a')"),
    (b'{"q": "1+1?", "a": [2]}', "answer key 'a' is list, not text or a number"),
    (b'{"q": 5, "a": "2"}', "prompt key 'q' is int, not text"),
    (b'{"q": "caf\xe9?", "a": "2"}', "not UTF-8 (byte 0xe9 at column 11)"),
    (b'{"q": "1+1?", "a": "2"', "invalid JSON: Expecting ',' delimiter (column 23)"),
    (b'["1+1?", "2"]', "a JSON list, not an object"),
]


@pytest.mark.parametrize(("line", "why"), BAD_LINES, ids=[w.split(" (")[0] for _, w in BAD_LINES])
def test_each_bad_row_is_named_by_file_and_line_and_skipped_or_refused(
    tmp_path: Path, line: bytes, why: str
) -> None:
    good = [json.dumps({"q": f"{i}+1?", "a": str(i + 1)}).encode() for i in range(30)]
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\n".join([*good[:3], b"", line, *good[3:], line]) + b"\n")  # a blank line is no row
    where = [f"{path}:5: {why}", f"{path}:{len(good) + 3}: {why}"]
    with pytest.raises(ValueError) as refused:
        envs.make_source("jsonl", path=str(path), prompt_key="q", answer_key="a")
    assert str(refused.value) == f"{where[0]} (2 bad rows in all; kwargs.on_bad_row: skip skips them)"
    src = envs.make_source("jsonl", path=str(path), prompt_key="q", answer_key="a", on_bad_row="skip")
    assert src.bad_rows == where and src.train_count + src.heldout_count == len(good)
    assert src.notices == [f"skipped bad row {w}" for w in where] + [
        f"{path}: 2 bad rows skipped (on_bad_row: skip)"
    ]


def cfg_with(kwargs: dict[str, Any], source: str = "jsonl", **extra: Any) -> Any:
    domain = {"name": "files", "source": source, "kwargs": kwargs, **extra}
    return parse_config(json.dumps({"data": {"domains": [domain], "heldout_size": 4}}))


@pytest.mark.parametrize(
    ("kwargs", "source", "message"),
    [
        ({}, "jsonl", "kwargs.path is required (the file to read)"),
        (
            {"path": "d.jsonl", "promt_key": "q"},
            "jsonl",
            "unknown kwarg 'promt_key'; kwargs: path, prompt_key, answer_key,",
        ),
        ({"path": 3}, "jsonl", "kwargs.path: Expected `str`, got `int`, got 3"),
        (
            {"path": "d.jsonl", "eval_fraction": 1.5},
            "jsonl",
            "kwargs.eval_fraction: Expected `float` < 1.0, got 1.5",
        ),
        (
            {"path": "d.jsonl", "on_bad_row": "warn"},
            "jsonl",
            "kwargs.on_bad_row: Invalid enum value 'warn', got 'warn'",
        ),
        (
            {"path": "nope.jsonl"},
            "jsonl",
            "kwargs.path='nope.jsonl': no such file (a relative path is read from ",
        ),
        ({"path": "."}, "jsonl", "kwargs.path='.' is a directory, not a file"),
        (
            {"path": "d.jsonl"},
            "dataset",
            "kwargs.path='d.jsonl' is a file; source 'dataset' reads a directory",
        ),
        ({"path": "d.jsonl", "split": "train"}, "jsonl", "kwargs.split is for source 'dataset' only"),
        (
            {"path": "d.jsonl", "eval_path": "d.jsonl", "eval_fraction": 0.1},
            "jsonl",
            "kwargs.eval_fraction: eval_path holds",
        ),
        ({"path": "d.jsonl"}, "parquet", "d.jsonl cannot be read as Parquet: "),
        ({"path": "."}, "dataset", ". is not a directory written by save_to_disk: "),
    ],
)
def test_bad_kwargs_are_refused_before_anything_starts_in_one_line_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], source: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    with pytest.raises(ConfigError) as refused:
        check_domains(cfg_with(kwargs, source))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(
        f"config: data.domains[0].kwargs {kwargs} do not suit task source"
    )
    assert message in line, line


def test_every_kwarg_is_documented_in_docs_data_md() -> None:
    text = (ROOT / "docs" / "data.md").read_text()
    assert [k for k in FileKwargs.__struct_fields__ if f"`{k}`" not in text] == []


def test_a_missing_package_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(
        ValueError, match=r"^source 'dataset' needs the datasets package: pip install 'rollstream\[data\]'$"
    ):
        envs.make_source("dataset", path=str(tmp_path))


def test_a_system_key_needs_a_chat_template() -> None:
    with pytest.raises(
        ConfigError, match=r"data.domains\[0\].kwargs.system_key is set but the model has no chat template"
    ):
        cfg_with({"path": "d.jsonl", "system_key": "sys"})
    chat = parse_config(
        json.dumps(
            {
                "model": {"init": {"chat_template": True}},
                "data": {
                    "domains": [
                        {"name": "f", "source": "jsonl", "kwargs": {"path": "d.jsonl", "system_key": "sys"}}
                    ]
                },
            }
        )
    )
    assert chat.data.domains[0].kwargs["system_key"] == "sys"


def test_the_example_config_resolves_to_the_shipped_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/my_data.yaml builds its source from the shipped files, its warm-up demonstrations
    score 1 with the domain's verifier and answer format, and a wrong answer scores 0."""
    monkeypatch.chdir(ROOT)
    cfg = parse_config((ROOT / "examples" / "my_data.yaml").read_text(), source="examples/my_data.yaml")
    check_domains(cfg)
    (domain,) = cfg.data.domains
    src = envs.make_source(domain.source, **domain.kwargs)
    assert (src.train_count, src.heldout_count) == (800, 128) and src.notices == []
    verifier = domain.verifier or src.default_verifier
    rng = random.Random(0)
    for p in [src.sample(rng) for _ in range(20)] + src.heldout(20):
        demo = format_answer(src.demonstration(p, rng), domain.answer)
        assert envs.score_response(
            verifier, demo, p.reference, answer=domain.answer, isolation="inline"
        ).correct
        wrong = format_answer(str(int(p.reference) + 1), domain.answer)
        assert not envs.score_response(
            verifier, wrong, p.reference, answer=domain.answer, isolation="inline"
        ).correct


def test_a_parquet_file_in_verls_layout(tmp_path: Path) -> None:
    """Chat-message prompts and the answer in the ``reward_model`` struct column, as verl's
    preprocessing scripts write them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} plus 1?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(20)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    src = envs.make_source(
        "parquet",
        path=str(tmp_path / "train.parquet"),
        answer_key="reward_model.ground_truth",
        eval_fraction=0.2,
    )
    problems = [*src.heldout(src.heldout_count), *(src.sample(random.Random(i)) for i in range(200))]
    assert {(p.prompt, p.reference) for p in problems} == {
        (f"What is {i} plus 1?", str(i + 1)) for i in range(20)
    }
