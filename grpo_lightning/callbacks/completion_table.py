"""The completions table as a person reads it: which rows, and a ``rich`` table on the console.

A table is a column mapping (``step``, ``prompt``, ``completion``, ``reward/<name>``...,
``advantage``, ``log_extra`` columns), one value per completion, as the completion logger builds it.
"""

from __future__ import annotations

import math
import numbers
import os
import random
from typing import Any, Sequence

FIXED_COLUMNS = ("step", "prompt", "completion", "advantage")


def unique_prompt_rows(prompts: Sequence[Any]) -> list[int]:
    """The first row of each distinct prompt, in order (``log_unique_prompts``).

    Prompts are compared by their text (``str``), so chat-message lists work too.

    >>> unique_prompt_rows(["a", "a", "b", "a", "c"])
    [0, 2, 4]
    """
    seen: set[str] = set()
    keep = []
    for i, prompt in enumerate(prompts):
        key = str(prompt)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return keep


def sample_rows(rows: Sequence[int], limit: int | None, seed: int) -> list[int]:
    """At most ``limit`` of ``rows`` (``None``: all), drawn with a private RNG seeded by ``seed``
    (the step), kept in table order; the global ``random`` state is untouched.

    >>> sample_rows([0, 1, 2], None, 5), sample_rows([0, 1, 2], 0, 5), len(sample_rows(range(10), 3, 5))
    ([0, 1, 2], [], 3)
    """
    rows = list(rows)
    if limit is None or limit >= len(rows):
        return rows
    return sorted(random.Random(seed).sample(rows, limit))


def pick_columns(columns: dict[str, list[Any]], rows: Sequence[int]) -> dict[str, list[Any]]:
    """The same columns, holding only ``rows``."""
    return {name: [values[i] for i in rows] for name, values in columns.items()}


def without_images(columns: dict[str, list[Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """``(columns, image_columns)``: the ``image`` column of vision-language prompts apart."""
    images = {name: values for name, values in columns.items() if name == "image"}
    return {name: values for name, values in columns.items() if name not in images}, images


def _cell(value: Any) -> Any:
    """One table cell as literal text (never rich markup: a completion may contain ``[bold]``)."""
    from rich.text import Text

    if value is None or (isinstance(value, float) and math.isnan(value)):
        return Text("None", style="dim")
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, int)):
        return Text(f"{float(value):.2f}")
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):  # chat messages
        text = Text()
        for message in value:
            text.append(f"{str(message.get('role', '')).upper()}\n", style="bold red")
            text.append(f"{message.get('content', '')}\n")
        return text
    return Text(str(value))


def render_completions(columns: dict[str, list[Any]], step: int) -> Any:
    """A ``rich`` panel titled ``Step <step>``: prompt, completion, one column per reward
    function, advantage, then the ``log_extra`` columns.

    Args:
        columns: The rows to show (already selected), as a column mapping.
        step: The optimizer step, for the title.

    Returns:
        A ``rich.panel.Panel``.
    """
    try:
        from rich.panel import Panel
        from rich.table import Table
    except ImportError as err:  # rich is a dependency; a trimmed environment may still lack it
        raise ImportError(
            "CompletionLogger prints its table with `rich`: pip install rich (a grpo-lightning "
            "dependency), or set num_completions_to_print: 0."
        ) from err
    rewards = [name for name in columns if name.startswith("reward/")]
    extras = [name for name in columns if name not in FIXED_COLUMNS and name not in rewards]
    table = Table(show_header=True, header_style="bold white", expand=True, show_lines=True)
    table.add_column("Prompt", style="bright_yellow")
    table.add_column("Completion", style="bright_green")
    for name in rewards:
        table.add_column(name.removeprefix("reward/"), style="bold cyan", justify="right")
    if "advantage" in columns:
        table.add_column("Advantage", style="bold magenta", justify="right")
    for name in extras:
        table.add_column(name, style="bright_white")
    shown = ["prompt", "completion", *rewards, *(["advantage"] if "advantage" in columns else []), *extras]
    for i in range(len(columns["prompt"])):
        table.add_row(*(_cell(columns[name][i]) for name in shown))
    return Panel(table, title=f"Step {step}", expand=False)


def print_completions(columns: dict[str, list[Any]], step: int, console: Any = None) -> None:
    """Print :func:`render_completions` to ``console`` (default: a console on stdout, 160
    columns wide when stdout is not a terminal and ``COLUMNS`` is unset, e.g. in a log file)."""
    if console is None:
        from rich.console import Console

        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            console.width = 160
    console.print(render_completions(columns, step))
