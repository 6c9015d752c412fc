"""Importable reward functions and callbacks for the facade tests (a YAML file can name them)."""

from __future__ import annotations

from transformers import TrainerCallback


def length_reward(completions, **kwargs):
    return [float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


def digit_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(ch.isdigit() for ch in t)) for t in texts]


class StopAfterFirstStep(TrainerCallback):
    """Stops training at the end of the first optimizer step (HF's control flag)."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = True
        return control
