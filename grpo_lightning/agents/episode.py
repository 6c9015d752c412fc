"""One rollout of the tool loop while it is generated: the ids, the masks, the conversation.

Layer L3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_lightning.agents.tool_images import ImageTurn, RowImages
from grpo_lightning.tools import AssistantTurn, Toolbox, ToolResult
from grpo_lightning.types import Rollout, RowInputs

#: ``Rollout.extra`` fields an agent rollout carries (reward functions receive them as columns).
NUM_TOOL_CALLS, NUM_TOOL_FAILURES, TOOL_IMAGES = "num_tool_calls", "num_tool_failures", "tool_images"
AGENT_FIELDS = (NUM_TOOL_CALLS, NUM_TOOL_FAILURES, TOOL_IMAGES)


@dataclass
class Episode:
    """A rollout in progress.

    ``completion_ids`` is everything after the prompt: the generated turns and the tool-turn
    ids between them, exactly as sampled and as the template renders the tool results (never
    re-tokenized). ``tool_mask`` is 1 where the policy produced the token, 0 for tool-turn ids.

    Attributes:
        prompt_ids: The rendered prompt (with its tools).
        toolbox: The tools this rollout may call.
        environment: Its environment instance (``None`` without environments).
        messages: The completion as chat messages: assistant turns (content, tool calls) and
            tool results, what conversational reward functions receive as ``completions``.
        ended_on_eos: Whether the last generated turn ended on an end-of-sequence id.
        iterations: Rounds of tool calls executed.
        tool_calls, tool_failures: Calls made, and how many failed.
        images: Images returned by tools (content blocks of type ``image``), in order.
        image_inputs: The row's image inputs (vision-language policies): the prompt's (an image
            prompt's ``model_inputs``, taken from ``prompt_ids`` when it carries them), then each
            tool turn's rendered images', in the order of their image tokens; ``None`` without images.
    """

    prompt_ids: list[int]
    toolbox: Toolbox
    environment: Any = None
    completion_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] | None = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    ended_on_eos: bool = False
    policy_version: int = 0
    iterations: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    images: list[Any] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    last_turn: AssistantTurn | None = None
    image_inputs: RowImages | None = None

    def __post_init__(self) -> None:
        if self.image_inputs is None:
            self.image_inputs = RowImages.of_prompt(self.prompt_ids)
        self.prompt_ids = list(self.prompt_ids)

    @property
    def context_ids(self) -> list[int]:
        """The ids the next turn is generated from: prompt and completion so far (a
        :class:`~grpo_lightning.agents.tool_images.ContextPrompt` with the row's image inputs when it has any)."""
        return self.context()

    def context(self, like: RowImages | None = None) -> list[int]:
        """:attr:`context_ids`; with ``like`` (another row's image inputs) a row without images
        gets empty ones in its fields (see :meth:`images_or_empty`)."""
        images = self.images_or_empty(like)
        if images is None:
            return self.prompt_ids + self.completion_ids
        return images.context(self.prompt_ids, self.completion_ids, self.token_images)

    @property
    def token_images(self) -> list[Any]:
        """The raw images that have tokens in the row, in their order: the prompt's, then the tool
        turns' rendered by the processor (none for a text-only policy, whose tool images stay text)."""
        if self.image_inputs is None:
            return []
        return [*self.image_inputs.images, *self.images]

    def add_generated(self, rollout: Rollout, turn_ids: list[int], ended_on_eos: bool, turn: AssistantTurn) -> None:
        """Append one generated turn (``turn_ids``, already cut to the budget) and its parse."""
        first = not self.completion_ids
        if first:
            self.policy_version, self.extra = rollout.policy_version, dict(rollout.extra)
        self.completion_ids.extend(turn_ids)
        self.tool_mask.extend([1] * len(turn_ids))
        if self.sampling_logprobs is not None:
            if rollout.sampling_logprobs is None:
                self.sampling_logprobs = None
            else:
                self.sampling_logprobs.extend(rollout.sampling_logprobs[: len(turn_ids)])
        self.ended_on_eos = ended_on_eos
        self.last_turn = turn
        self.messages.append(turn.message())

    def add_tool_turn(self, ids: list[int], results: list[ToolResult], images: ImageTurn | None = None) -> None:
        """Append the tool-turn ids (out of the loss), the tool messages, and the inputs of the
        images the ids were rendered with (``images``, whose ids are ``ids``; ``None``: text only)."""
        if images is not None:
            offset = len(self.completion_ids)
            if self.image_inputs is None:
                self.image_inputs = RowImages.start(images, offset, len(self.prompt_ids))
            else:
                self.image_inputs.add(images, offset)
        self.completion_ids.extend(ids)
        self.tool_mask.extend([0] * len(ids))
        if self.sampling_logprobs is not None:
            self.sampling_logprobs.extend([0.0] * len(ids))
        self.messages.extend(result.message() for result in results)
        for result in results:
            if isinstance(result.content, list):
                self.images.extend(b.get("image") for b in result.content if isinstance(b, dict) and b.get("type") == "image")
        self.iterations += 1

    def count(self, results: list[ToolResult]) -> None:
        self.tool_calls += len(results)
        self.tool_failures += sum(result.failed for result in results)

    @property
    def wants_tools(self) -> bool:
        """The last turn ended properly and asked for tools."""
        return self.ended_on_eos and self.last_turn is not None and bool(self.last_turn.tool_calls)

    def rollout(self, like: RowImages | None = None) -> Rollout:
        """The finished rollout (``like``: see :meth:`row_inputs`)."""
        extra = {**self.extra, NUM_TOOL_CALLS: self.tool_calls, NUM_TOOL_FAILURES: self.tool_failures,
                 TOOL_IMAGES: list(self.images)}
        return Rollout(
            prompt_ids=list(self.prompt_ids), completion_ids=list(self.completion_ids), ended_on_eos=self.ended_on_eos,
            policy_version=self.policy_version, sampling_logprobs=self.sampling_logprobs, tool_mask=list(self.tool_mask),
            extra=extra, model_inputs=self.row_inputs(like),
            images=self.token_images or None,
        )

    def images_or_empty(self, like: RowImages | None) -> RowImages | None:
        """The row's image inputs; when it has none and ``like`` (another row's) is given, empty
        ones in ``like``'s fields (a batch takes image inputs for all rows or none)."""
        if self.image_inputs is not None or like is None:
            return self.image_inputs
        return RowImages.empty(like, len(self.prompt_ids))

    def row_inputs(self, like: RowImages | None = None) -> RowInputs | None:
        """The one-row :class:`~grpo_lightning.types.RowInputs` of the images (``like``: see
        :meth:`images_or_empty`)."""
        images = self.images_or_empty(like)
        return None if images is None else images.row_inputs(len(self.completion_ids))


__all__ = ["AGENT_FIELDS", "Episode", "NUM_TOOL_CALLS", "NUM_TOOL_FAILURES", "TOOL_IMAGES"]
