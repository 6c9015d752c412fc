"""``GRPOTrainer.push_to_hub``: a model card beside the saved model, and the upload of that folder
with ``huggingface_hub`` (``create_repo`` + ``upload_folder``, the library's public API).

Layer L7 (trl_compat).
"""

from __future__ import annotations

import os
from typing import Any


def repo_id(args: Any) -> str:
    """``args.hub_model_id``, else the output folder's name (as transformers does)."""
    return args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))


def model_card(folder: str, trainer: Any, *, model_name: str | None = None, dataset_name: str | None = None,
               tags: str | list[str] | None = None, **kwargs: Any) -> str:
    """Write ``folder/README.md``: what was trained, with what, and how to load it; its path."""
    tags = [tags] if isinstance(tags, str) else list(tags or [])
    base = trainer.model_source if isinstance(trainer.model_source, str) else type(trainer.model_source).__name__
    lines = [
        "---",
        "library_name: transformers",
        "tags:",
        *(f"- {t}" for t in dict.fromkeys(["grpo", "grpo-lightning", *tags])),
        "---",
        "",
        f"# {model_name or repo_id(trainer.args)}",
        "",
        f"Trained with GRPO (grpo-lightning) from `{base}`"
        + (f" on `{dataset_name}`." if dataset_name else "."),
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{repo_id(trainer.args)}")',
        "```",
        "",
    ]
    path = os.path.join(folder, "README.md")
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def upload(folder: str, args: Any, *, commit_message: str | None, blocking: bool, token: str | None,
           revision: str | None, private: bool | None = None) -> Any:
    """Create the repository (if needed; private when ``private``, else as ``args.hub_private_repo``
    says, as transformers decides) and upload ``folder``: the commit info, or a ``Future`` when not
    ``blocking``."""
    from huggingface_hub import create_repo, upload_folder

    token = token or args.hub_token
    private = private if private is not None else args.hub_private_repo
    url = create_repo(repo_id(args), token=token, private=private, exist_ok=True)
    return upload_folder(
        repo_id=getattr(url, "repo_id", repo_id(args)), folder_path=folder, commit_message=commit_message or "Upload",
        token=token, revision=revision or args.hub_revision, run_as_future=not blocking,
    )
