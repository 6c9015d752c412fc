"""Loading the prompt dataset from the Hub, a ``save_to_disk`` folder, a data folder or files.

No lightning here: these are helpers the Lightning datamodule uses.
"""

from __future__ import annotations

import glob
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ``datasets`` is imported on use: ``is_conversational`` callers stay light
    import datasets

# File extension → ``datasets`` packaged builder.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
PACKAGED_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt is a conversation: a list of ``{"role": ..., "content": ...}`` messages.

    Follows TRL's ``is_conversational``: a non-empty list whose first item is a dict with "role".

    Args:
        prompt: One value of the ``prompt`` column.

    Returns:
        True for a message list, False for plain text (or anything else).
    """
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and isinstance(prompt[0], dict)
        and "role" in prompt[0]
    )


def _builder_for(path: str) -> str | None:
    name = path.lower()
    for ext in _COMPRESSIONS:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return FILE_BUILDERS.get(os.path.splitext(name)[1])


def _expand_files(pattern: str) -> list[str]:
    pattern = os.path.expanduser(pattern)
    if glob.has_magic(pattern):
        files = sorted(glob.glob(pattern, recursive=True))
        if not files:
            raise FileNotFoundError(f"no file matches the dataset pattern '{pattern}'.")
        return files
    if not os.path.isfile(pattern):
        raise FileNotFoundError(
            f"dataset file '{pattern}' does not exist (resolved to '{os.path.abspath(pattern)}')."
        )
    return [pattern]


def _load_files(source: str, files: list[str], builder: str, split: str, **kwargs: Any):
    import datasets

    if all(os.path.getsize(f) == 0 for f in files):
        raise ValueError(f"dataset '{source}' is empty: {files} contain no data.")
    try:
        return datasets.load_dataset(builder, data_files={split: files}, split=split, **kwargs)
    except (StopIteration, ValueError) as err:
        # json says "no rows" with StopIteration, csv with "corresponds to no data".
        if isinstance(err, StopIteration) or "corresponds to no data" in str(err):
            raise ValueError(f"dataset '{source}' is empty: {files} contain no rows.") from err
        raise


def _load_from_disk(path: str, split: str, streaming: bool):
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except IndexError as err:  # datasets writes zero shards for an empty dataset, then can't read it
        raise ValueError(f"dataset folder '{path}' is empty: it holds no data shards.") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(
                f"dataset folder '{path}' has splits {sorted(loaded)}, not '{split}': set "
                "data.split (or the matching split setting) to one of them."
            )
        loaded = loaded[split]
    return loaded.to_iterable_dataset() if streaming else loaded


def _looks_local(spec: str) -> bool:
    return spec.startswith((".", "~")) or os.path.isabs(spec)


def _load(
    path_or_name: str,
    name: str | None,
    split: str,
    data_files: str | list[str] | dict | None,
    streaming: bool,
    cache_dir: str | None,
):
    import datasets

    kwargs: dict[str, Any] = {"streaming": streaming, "cache_dir": cache_dir}
    local = os.path.expanduser(path_or_name)
    if data_files is not None:
        if path_or_name in PACKAGED_BUILDERS or os.path.isdir(local):
            target = path_or_name if path_or_name in PACKAGED_BUILDERS else local
            return datasets.load_dataset(target, data_files=data_files, split=split, **kwargs)
        return datasets.load_dataset(
            path_or_name, name=name, data_files=data_files, split=split, **kwargs
        )
    if os.path.isdir(local):
        has = set(os.listdir(local))
        if "dataset_dict.json" in has or {"state.json", "dataset_info.json"} <= has:
            return _load_from_disk(local, split, streaming)
        return datasets.load_dataset(local, name=name, split=split, **kwargs)
    builder = _builder_for(path_or_name)
    if builder is not None:
        files = _expand_files(path_or_name)
        return _load_files(path_or_name, files, builder, split, **kwargs)
    if _looks_local(path_or_name):
        raise FileNotFoundError(
            f"dataset path '{path_or_name}' does not exist. Give an existing .jsonl/.json/"
            ".parquet/.csv file (or glob), a folder of such files, a save_to_disk folder, or a "
            "Hugging Face Hub dataset name."
        )
    try:
        return datasets.load_dataset(path_or_name, name=name, split=split, **kwargs)
    except Exception as err:
        err.add_note(
            f"'{path_or_name}' is not an existing local file or folder, so it was looked up as a "
            "Hugging Face Hub dataset name."
        )
        raise


def load_prompt_dataset(
    path_or_name: str,
    *,
    name: str | None = None,
    split: str = "train",
    data_files: str | list[str] | dict | None = None,
    prompt_column: str = "prompt",
    prompt_template: str | None = None,
    streaming: bool = False,
    cache_dir: str | None = None,
    default_prompt: Any = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """Load a prompt dataset and make sure it has a ``prompt`` column.

    Args:
        path_or_name: One of: a Hub dataset name (``"openai/gsm8k"``); a folder written by
            ``Dataset.save_to_disk``/``DatasetDict.save_to_disk``; a folder of data files; a
            ``.jsonl``/``.json``/``.parquet``/``.csv`` file or glob (builder from the extension);
            or a packaged builder name (``"json"``, ``"csv"``, ...) together with ``data_files``;
            or an in-memory ``datasets.Dataset`` (from Python).
        name: The dataset configuration name (Hub datasets with several configs).
        split: The split to load. A single file or glob is loaded as this split.
        data_files: Files handed to ``datasets.load_dataset`` as ``data_files``.
        prompt_column: The column holding the prompts; renamed to ``prompt`` when different.
        prompt_template: Build the ``prompt`` column from other columns instead, with a Python
            format string such as ``"Make {target} from {nums}."``.
        streaming: Return an ``IterableDataset`` instead of loading everything.
        cache_dir: ``datasets`` cache folder; ``None`` uses the default.
        default_prompt: The prompt of every row when the dataset has no prompt column (an
            environment whose ``reset()`` makes the prompt: the rows only route and parametrise);
            ``None``: a missing prompt column is an error.

    Returns:
        The dataset, with a ``prompt`` column.

    Raises:
        FileNotFoundError: A local file, glob or path does not exist.
        ValueError: The prompt column is missing, or the dataset is empty.
    """
    import datasets

    in_memory = isinstance(path_or_name, (datasets.Dataset, datasets.IterableDataset))  # from Python (or an agent's placeholder)
    dataset = path_or_name if in_memory else _load(str(path_or_name), name, split, data_files, streaming, cache_dir)
    label = f"'{path_or_name}'" + (f" (config '{name}')" if name else "") + f", split '{split}'"
    columns = dataset.column_names
    if columns is None:  # a stream without declared features: peek at the first row
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"dataset {label} is empty: it has no rows to train on.")
        columns = list(first)
    if prompt_template is not None:
        dataset = _apply_template(dataset, prompt_template, list(columns), label)
        _check_prompts(dataset, label, f"rendered by data.prompt_template={prompt_template!r}")
        return dataset
    if prompt_column not in columns and default_prompt is not None:
        dataset = dataset.map(lambda row: {"prompt": default_prompt})
        columns = [*columns, "prompt"]
    if prompt_column not in columns:
        hint = "" if prompt_column != "prompt" else " (for example data.prompt_column: question)"
        raise ValueError(
            f"dataset {label} has no '{prompt_column}' column; its columns are {list(columns)}. "
            f"Set data.prompt_column to the column that holds the prompts{hint}, or rename that "
            "column to 'prompt' in the dataset."
        )
    if prompt_column != "prompt":
        if "prompt" in columns:
            raise ValueError(
                f"dataset {label} has both a 'prompt' column and data.prompt_column="
                f"'{prompt_column}'; remove or rename the 'prompt' column, or leave "
                "data.prompt_column at 'prompt'."
            )
        dataset = dataset.rename_column(prompt_column, "prompt")
    if isinstance(dataset, datasets.Dataset) and len(dataset) == 0:
        raise ValueError(f"dataset {label} is empty: it has no rows to train on.")
    _check_prompts(dataset, label, f"in column '{prompt_column}' (data.prompt_column)")
    return dataset


def prompt_problem(prompt: Any) -> str | None:
    """Why ``prompt`` cannot be a prompt, or ``None`` when it can.

    A prompt is non-empty text, or a non-empty list of ``{"role": str, "content": ...}``
    messages (an assistant message may carry ``tool_calls`` instead of content).

    >>> prompt_problem("2+2="), prompt_problem([{"role": "user", "content": "hi"}])
    (None, None)
    >>> prompt_problem(None), prompt_problem("  "), prompt_problem([{"content": "hi"}])
    ('null', 'empty text', 'message 0 is not a {"role": ..., "content": ...} dict')
    """
    if prompt is None:
        return "null"
    if isinstance(prompt, str):
        return None if prompt.strip() else "empty text"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return "an empty message list"
        for i, message in enumerate(prompt):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and (message.get("content") is not None or message.get("tool_calls"))
            ):
                return f'message {i} is not a {{"role": ..., "content": ...}} dict'
        return None
    return f"{type(prompt).__name__} value, neither text nor a list of messages"


def _check_prompts(dataset: Any, label: str, where: str, shown: int = 5) -> None:
    """Check every prompt once, at load, so a bad row cannot crash a run when it is drawn.

    Streamed datasets are not read ahead; their rows are checked when drawn.
    """
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        return
    bad = []
    for index, prompt in enumerate(dataset["prompt"]):
        problem = prompt_problem(prompt)
        if problem is not None:
            bad.append(f"row {index}: {problem}")
    if bad:
        more = f" (and {len(bad) - shown} more)" if len(bad) > shown else ""
        raise ValueError(
            f"dataset {label} has {len(bad)} unusable prompt(s) {where}: {'; '.join(bad[:shown])}{more}. "
            "A prompt must be non-empty text or a non-empty list of {\"role\": ..., \"content\": ...} "
            "messages: fix or drop those rows (e.g. dataset.filter), or point data.prompt_column / "
            "data.prompt_template at the right column."
        )


def _apply_template(dataset: Any, template: str, columns: list[str], label: str) -> Any:
    """Add a ``prompt`` column rendered from ``template`` and each row's columns."""
    import string

    fields = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(template) if name}
    missing = sorted(fields - set(columns))
    if missing:
        raise ValueError(
            f"data.prompt_template uses {missing}, which dataset {label} does not have; its columns "
            f"are {columns}."
        )
    if "prompt" in columns:
        raise ValueError(
            f"dataset {label} already has a 'prompt' column: remove data.prompt_template to use it, "
            "or rename that column."
        )
    return dataset.map(lambda row: {"prompt": template.format(**row)})


__all__ = ["FILE_BUILDERS", "is_conversational", "load_prompt_dataset", "prompt_problem"]
