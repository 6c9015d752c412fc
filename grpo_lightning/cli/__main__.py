"""``python -m grpo_lightning.cli``: the same as the ``grpo`` command."""

from grpo_lightning.cli import main

main()
