"""Loading prompt datasets from files, folders, save_to_disk output and (mocked) Hub names."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from grpo_lightning.data.sources import is_conversational, load_prompt_dataset

ROWS = [
    {"prompt": "1+1=", "answer": "2"},
    {"prompt": "2+2=", "answer": "4"},
    {"prompt": "3+3=", "answer": "6"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def cache(tmp_path: Path) -> str:
    return str(tmp_path / "hf_cache")


def test_jsonl_file(tmp_path: Path, cache: str) -> None:
    ds = load_prompt_dataset(str(_write_jsonl(tmp_path / "p.jsonl", ROWS)), cache_dir=cache)
    assert isinstance(ds, datasets.Dataset)
    assert ds["prompt"] == ["1+1=", "2+2=", "3+3="] and ds.column_names == ["prompt", "answer"]


def test_file_loaded_as_requested_split(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert len(load_prompt_dataset(str(path), split="test", cache_dir=cache)) == 3


def test_parquet_csv_json_and_glob(tmp_path: Path, cache: str) -> None:
    frame = datasets.Dataset.from_list(ROWS)
    frame.to_parquet(str(tmp_path / "p.parquet"))
    frame.to_csv(str(tmp_path / "p.csv"), index=False)
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    for name in ("p.parquet", "p.csv", "p.json"):
        ds = load_prompt_dataset(str(tmp_path / name), cache_dir=cache)
        assert ds["prompt"] == [r["prompt"] for r in ROWS], name
    _write_jsonl(tmp_path / "shard-0.jsonl", ROWS[:2])
    _write_jsonl(tmp_path / "shard-1.jsonl", ROWS[2:])
    assert len(load_prompt_dataset(str(tmp_path / "shard-*.jsonl"), cache_dir=cache)) == 3


def test_builder_name_with_data_files(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = load_prompt_dataset("json", data_files=str(path), cache_dir=cache)
    assert len(ds) == 3


def test_folder_of_files_with_splits(tmp_path: Path, cache: str) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", ROWS)
    _write_jsonl(folder / "test.jsonl", ROWS[:1])
    assert len(load_prompt_dataset(str(folder), cache_dir=cache)) == 3
    assert len(load_prompt_dataset(str(folder), split="test", cache_dir=cache)) == 1


def test_save_to_disk_dataset_and_dict(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": ds, "eval": ds.select([0])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompt_dataset(str(tmp_path / "single"))) == 3
    assert len(load_prompt_dataset(str(tmp_path / "dd"), split="eval")) == 1
    with pytest.raises(ValueError, match=r"splits \['eval', 'train'\], not 'validation'"):
        load_prompt_dataset(str(tmp_path / "dd"), split="validation")


def test_prompt_column_renamed(tmp_path: Path, cache: str) -> None:
    rows = [{"question": r["prompt"], "answer": r["answer"]} for r in ROWS]
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    ds = load_prompt_dataset(str(path), prompt_column="question", cache_dir=cache)
    assert ds.column_names == ["prompt", "answer"] and ds[0]["prompt"] == "1+1="


def test_missing_prompt_column_error(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(str(path), cache_dir=cache)
    msg = str(info.value)
    assert str(path) in msg and "'question'" in msg and "'answer'" in msg
    assert "data.prompt_column" in msg and "rename" in msg
    with pytest.raises(ValueError, match="no 'text' column"):
        load_prompt_dataset(str(path), prompt_column="text", cache_dir=cache)


def test_prompt_column_clash(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "question": "b"}])
    with pytest.raises(ValueError, match="both a 'prompt' column"):
        load_prompt_dataset(str(path), prompt_column="question", cache_dir=cache)


def test_missing_file_and_empty_glob(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_prompt_dataset(str(tmp_path / "nope-*.parquet"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(str(tmp_path / "some_folder"))


@pytest.mark.parametrize("name, text", [("e.jsonl", ""), ("e.csv", "prompt,answer\n")])
def test_empty_dataset(tmp_path: Path, cache: str, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match="empty"):
        load_prompt_dataset(str(tmp_path / name), cache_dir=cache)


def test_empty_save_to_disk(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="empty"):
        load_prompt_dataset(str(tmp_path / "empty"))


def test_hub_name_is_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list([{"question": "q"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_prompt_dataset("openai/gsm8k", name="main", split="test", prompt_column="question")
    assert ds.column_names == ["prompt"]
    assert calls[0][0] == "openai/gsm8k"
    assert calls[0][1]["name"] == "main" and calls[0][1]["split"] == "test"


def test_streaming_file(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"question": "a"}, {"question": "b"}])
    ds = load_prompt_dataset(str(path), streaming=True, prompt_column="question", cache_dir=cache)
    assert isinstance(ds, datasets.IterableDataset)
    assert [row["prompt"] for row in ds] == ["a", "b"]


def test_gsm8k_from_shared_assets(shared_assets: Path, cache: str) -> None:
    path = shared_assets / "datasets" / "gsm8k" / "train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not present")
    ds = load_prompt_dataset(str(path), prompt_column="question", cache_dir=cache)
    assert len(ds) == 7473 and set(ds.column_names) == {"prompt", "answer"}
    with pytest.raises(ValueError, match="data.prompt_column"):
        load_prompt_dataset(str(path), cache_dir=cache)


def test_is_conversational() -> None:
    assert is_conversational([{"role": "user", "content": "hi"}])
    assert not is_conversational("hi")
    assert not is_conversational([])
    assert not is_conversational(["hi"])
    assert not is_conversational(None)


def test_prompt_template_builds_the_prompt_column(tmp_path):
    import json

    from grpo_lightning.data.sources import load_prompt_dataset

    path = tmp_path / "cd.jsonl"
    path.write_text("\n".join(json.dumps({"nums": [3, 5, 7], "target": 22}) for _ in range(3)))
    dataset = load_prompt_dataset(str(path), prompt_template="Use {nums} to make {target}.")
    assert dataset[0]["prompt"] == "Use [3, 5, 7] to make 22." and dataset[0]["target"] == 22
    with pytest.raises(ValueError, match=r"data\.prompt_template uses \['goal'\]"):
        load_prompt_dataset(str(path), prompt_template="Make {goal}")


def test_bad_prompts_are_found_at_load_naming_rows_and_column(tmp_path: Path, cache: str) -> None:
    rows = [{"question": q} for q in ["1+1=", None, "2+2=", "", "3+3=", "   "]]
    path = _write_jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(str(path), prompt_column="question", cache_dir=cache)
    message = str(err.value)
    assert "3 unusable prompt(s) in column 'question' (data.prompt_column)" in message
    assert "row 1: null; row 3: empty text; row 5: empty text" in message and "filter" in message


def test_bad_conversational_prompts_are_found_at_load(tmp_path: Path, cache: str) -> None:
    good = [{"role": "user", "content": "hi"}]
    rows = [{"prompt": p} for p in [good, [], [{"role": "user", "content": None}], good]]
    with pytest.raises(ValueError, match=r"row 1: an empty message list; row 2: message 0 is not a"):
        load_prompt_dataset(str(_write_jsonl(tmp_path / "c.jsonl", rows)), cache_dir=cache)
    numbers = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": 1}, {"prompt": 2}])
    with pytest.raises(ValueError, match=r"row 0: int value, neither text nor a list of messages"):
        load_prompt_dataset(str(numbers), cache_dir=cache)


def test_a_template_rendering_empty_prompts_is_reported(tmp_path: Path, cache: str) -> None:
    path = _write_jsonl(tmp_path / "t.jsonl", [{"q": "1+1="}, {"q": ""}])
    with pytest.raises(ValueError, match=r"rendered by data.prompt_template='\{q\}': row 1: empty text"):
        load_prompt_dataset(str(path), prompt_template="{q}", cache_dir=cache)
    many = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": ""}] * 8)
    with pytest.raises(ValueError, match=r"row 4: empty text \(and 3 more\)"):
        load_prompt_dataset(str(many), cache_dir=cache)


def test_a_routing_dataset_without_prompts_gets_the_environment_prompt(tmp_path: Path, cache: str) -> None:
    """Rows that only route (``environment``) and parametrise: an environment's ``reset()`` makes
    the prompt, so each row gets the empty user message it fills; without ``default_prompt`` the
    missing column is still an error naming the setting."""
    from grpo_lightning.data.agent_wiring import ENVIRONMENT_PROMPT

    path = str(_write_jsonl(tmp_path / "r.jsonl", [{"environment": "coding", "level": 1}, {"environment": "game", "level": 2}]))
    ds = load_prompt_dataset(path, cache_dir=cache, default_prompt=ENVIRONMENT_PROMPT)
    assert ds["prompt"] == [ENVIRONMENT_PROMPT] * 2 and ds["environment"] == ["coding", "game"] and ds["level"] == [1, 2]
    with pytest.raises(ValueError, match="has no 'prompt' column.*data.prompt_column"):
        load_prompt_dataset(path, cache_dir=cache)
