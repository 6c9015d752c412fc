"""Chat templates in the tool loop: rendering with tools, the tokens of a tool turn, and the
prefix-preserving check.

Token in, token out: a multi-turn completion is never re-rendered. After an assistant turn that
called tools, the loop appends the tokens the chat template puts between that turn's end-of-turn
token and the next assistant turn (the tool results and the new generation prompt). Those tokens
are the difference between two renderings of a small probe conversation::

    before = render([user, assistant(tool calls)])                      cut after its last EOS
    after  = render([user, assistant(tool calls), tool...], add_generation_prompt=True)
    tool-turn tokens = after[len(before):]

which is only right when ``before`` is a token prefix of ``after``: the template must be
*prefix-preserving* (appending a tool message does not re-render the earlier turns). The check
also runs a second round (``[user, assistant, tool]`` + another call and its result): appending the
next assistant turn must not re-render the tool results, and the second tool turn must be the same
ids as the first (the loop appends the one-round ids every round). Qwen2.5's template passes;
Qwen3's does not (the last assistant turn gets an empty ``<think>`` block, an earlier one does
not), nor does DeepSeek-V3's (see :mod:`grpo_lightning.tools.templates_deepseek`), so fixed
training templates are used for them, and any other template that fails the check is refused
with a clear message.

Layer L1: pure python (the tokenizer is duck-typed).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from grpo_lightning.tools.templates_deepseek import fix_deepseek_v3


class TemplateError(ValueError):
    """The chat template cannot drive a tool loop."""


_PROBE_USER = {"role": "user", "content": "What is 2 + 3?"}


def _probe_assistant(names: Sequence[str]) -> dict[str, Any]:
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}} for name in names]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def _chat_options(messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]] | None,
                  add_generation_prompt: bool, chat_template: str | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``apply_chat_template``'s options (but ``tokenize``): with ``add_generation_prompt``, a
    final assistant message is continued instead of a new turn opened."""
    continue_final = bool(messages) and messages[-1].get("role") == "assistant" and add_generation_prompt
    options: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt and not continue_final,
        "continue_final_message": continue_final, **kwargs,
    }  # fmt: skip
    if tools:
        options["tools"] = list(tools)
    if chat_template is not None:
        options["chat_template"] = chat_template
    return options


def render_ids(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False, chat_template: str | None = None, **kwargs: Any,
) -> list[int]:
    """``apply_chat_template`` as token ids (a final assistant message is continued, as for prompts)."""
    options = {"tokenize": True, "return_dict": False, **_chat_options(messages, tools, add_generation_prompt,
                                                                       chat_template, kwargs)}
    ids = tokenizer.apply_chat_template(list(messages), **options)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def image_blocks(content: Any) -> list[Any]:
    """The images of a tool message's content blocks (``{"type": "image", "image": ...}``), in order."""
    if not isinstance(content, list):
        return []
    return [block.get("image") for block in content if isinstance(block, dict) and block.get("type") == "image"]


def image_parts(content: Any) -> Any:
    """A tool message's content for a processor's chat template: image blocks become
    ``{"type": "image"}`` placeholders (the processor gets the images), text blocks stay."""
    if not isinstance(content, list):
        return content
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "image":
            parts.append({"type": "image"})
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
    return parts


def text_only(content: Any) -> Any:
    """A tool message's content for a text-only model: content blocks become their text parts."""
    if not isinstance(content, list):
        return content
    return "".join(str(block.get("text", "")) for block in content if isinstance(block, dict) and block.get("type") == "text")


class ToolTurnTemplate:
    """Renders tool turns as token ids with one chat template (the model's or a fixed one).

    Args:
        tokenizer: The policy's tokenizer.
        eos_token_ids: Every id that ends an assistant turn.
        chat_template_kwargs: The run's ``chat_template_kwargs`` (e.g. ``enable_thinking``).
        chat_template: The template to use instead of the tokenizer's (``None``: its own).
        max_calls_per_turn: The parser family's limit (Llama 3.1/3.2: 1): the start-up check then
            renders no exchange with more calls.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], chat_template_kwargs: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, max_calls_per_turn: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in ("tools", "chat_template")}
        self.chat_template = chat_template
        self.max_calls_per_turn = max_calls_per_turn
        # Gemma 4's templates find a tool result's call by tool_call_id (see _exchange).
        template_text = chat_template or getattr(tokenizer, "chat_template", None)
        self.pairs_results_by_id = isinstance(template_text, str) and "tool_call_id" in template_text

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> list[int]:
        """A prompt's ids, with ``tools`` in the system part."""
        return render_ids(self.tokenizer, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                          chat_template=self.chat_template, **self.kwargs)

    def render_with_images(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[dict[str, Any]] | None,
                           images: Sequence[Any], processor: Any) -> Mapping[str, Any]:
        """:meth:`render` for a prompt whose messages hold ``{"type": "image"}`` parts: the
        template renders the text (``tools`` in the system part, one placeholder per image part)
        and ``processor`` encodes it with ``images``, expanding each placeholder into the model's
        image tokens. Returns the processor's outputs (``input_ids`` ``(1, L)``, pixel inputs)."""
        options = {"tokenize": False, **_chat_options(messages, tools, True, self.chat_template, self.kwargs)}
        text = self.tokenizer.apply_chat_template(list(messages), **options)
        return processor(text=[text], images=[list(images)], return_tensors="pt")

    def lists_tools(self, tools: Sequence[dict[str, Any]]) -> bool:
        """Whether the template puts ``tools`` (their JSON schemas) into a prompt at all (DeepSeek-V3's
        ignores the ``tools`` argument: the tools must then be described in the system prompt)."""
        return self.render([_PROBE_USER], tools=tools) != self.render([_PROBE_USER])

    def tool_turn_ids(self, tool_messages: Sequence[Mapping[str, Any]], call_names: Sequence[str]) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token for these tool messages, up
        to and including the next assistant generation prompt.

        Raises:
            TemplateError: When the template is not prefix-preserving for this exchange.
        """
        return self._tool_turn_ids([_PROBE_USER], tool_messages, call_names)

    def tool_turn_with_images(self, tool_messages: Sequence[Mapping[str, Any]], call_names: Sequence[str],
                              processor: Any) -> tuple[list[int], dict[str, Any]]:
        """:meth:`tool_turn_ids` for a vision-language policy: the tool messages' image blocks
        are rendered as the template's image placeholders, and both probe renderings are
        encoded by ``processor`` (which expands each placeholder into the model's image tokens).

        Returns:
            The tool-turn ids and the processor's outputs for the probe rendering with the tool
            images alone (its ``input_ids`` ``(1, L)``; Qwen-VL: ``pixel_values`` ``(patches, D)``,
            ``image_grid_thw`` ``(images, 3)``).

        Raises:
            TemplateError: When the processor renderings are not prefix-preserving.
        """
        images = [image for m in tool_messages for image in image_blocks(m.get("content"))]
        assistant, messages = self._exchange([{**m, "content": image_parts(m.get("content"))} for m in tool_messages],
                                             call_names)
        before_text = self._render([_PROBE_USER, assistant], tokenize=False)
        after_text = self._render([_PROBE_USER, assistant, *messages], add_generation_prompt=True, tokenize=False)
        before = _first_row(processor(text=[before_text], return_tensors="pt")["input_ids"])
        encoded = processor(text=[after_text], images=images or None, return_tensors="pt")
        after = _first_row(encoded["input_ids"])
        cut = self._cut_after_turn(before, after)
        if after[: len(cut)] != cut:
            raise _not_prefix_preserving("appending a tool message with images re-renders the earlier turns")
        inputs = {k: v for k, v in encoded.items() if k != "attention_mask"}
        return after[len(cut):], inputs

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                tokenize: bool = True) -> Any:
        try:
            if not tokenize:
                return self.tokenizer.apply_chat_template(
                    list(messages), add_generation_prompt=add_generation_prompt, tokenize=False,
                    **({} if self.chat_template is None else {"chat_template": self.chat_template}), **self.kwargs)
            return render_ids(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                              chat_template=self.chat_template, **self.kwargs)
        except Exception as err:  # jinja2 raises many types; a template that cannot render a tool exchange
            raise TemplateError(
                f"the chat template cannot render a tool-call exchange ({type(err).__name__}: {err}); tool calls are "
                "passed in the chat-template format (arguments as a mapping). Known fixes exist for: "
                f"{', '.join(TEMPLATE_FIXES)}; for another model give a template that can in data.agent.chat_template."
            ) from err

    def _tool_turn_ids(self, history: Sequence[Mapping[str, Any]], tool_messages: Sequence[Mapping[str, Any]],
                       call_names: Sequence[str]) -> list[int]:
        """The tool turn after ``history`` + an assistant turn calling ``call_names``."""
        assistant, messages = self._exchange([{**m, "content": text_only(m.get("content"))} for m in tool_messages],
                                             call_names)
        after = self._render([*history, assistant, *messages], add_generation_prompt=True)
        before = self._cut_after_turn(self._render([*history, assistant]), after)
        if after[: len(before)] != before:
            raise _not_prefix_preserving("appending a tool message re-renders the earlier turns")
        return after[len(before):]

    def _exchange(self, tool_messages: list[dict[str, Any]], call_names: Sequence[str]
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The probe assistant turn calling ``call_names`` and the tool messages that answer it.
        A template that matches results to calls by ``tool_call_id`` (Gemma 4's: without ids every
        result is named after the turn's last call) gets ids pairing them in order, call ``i`` with
        result ``i`` (the loop's results come one per call, in call order); others render as given."""
        assistant = _probe_assistant(call_names or [m.get("name", "tool") for m in tool_messages])
        if not self.pairs_results_by_id or len(assistant["tool_calls"]) != len(tool_messages):
            return assistant, tool_messages
        for i, call in enumerate(assistant["tool_calls"]):
            call["id"] = f"call_{i}"
        return assistant, [{**m, "tool_call_id": f"call_{i}"} for i, m in enumerate(tool_messages)]

    def _cut_after_turn(self, ids: list[int], after: list[int]) -> list[int]:
        """``ids`` (a rendering ending with an assistant turn) up to and including that turn's
        end-of-turn id. A template that leaves the turn open for the next message's role token to
        end it (GLM-4: ``<|observation|>`` before tool results, the token the model ends a calling
        turn with) has that id right after ``ids`` in ``after`` (the rendering with the tool
        messages): then ``ids`` plus it. Otherwise the template closes the turn itself (Qwen's
        ``<|im_end|>``): up to the last end-of-turn id of ``ids``."""
        if len(after) > len(ids) and after[: len(ids)] == ids and after[len(ids)] in self.eos_token_ids:
            return after[: len(ids) + 1]
        ends = [i for i, token in enumerate(ids) if token in self.eos_token_ids]
        if ends:
            return ids[: ends[-1] + 1]
        raise TemplateError(
            "the chat template ends an assistant turn with none of the end-of-sequence ids "
            f"{sorted(self.eos_token_ids)}: the tool loop cannot tell where a turn ends. Use a chat model whose "
            "template closes assistant turns with its EOS token, or set data.agent.chat_template."
        )

    def check(self) -> None:
        """The start-up check: a one-call and a two-call exchange (unless the family allows one call
        a turn) render prefix-preservingly, and so does a second round, whose tool turn is the same
        ids as the first round's."""
        result = {"role": "tool", "name": "probe", "content": "5"}
        first = self.tool_turn_ids([result], ["probe"])
        if self.max_calls_per_turn is None or self.max_calls_per_turn >= 2:
            self.tool_turn_ids(
                [{"role": "tool", "name": "a", "content": "1"}, {"role": "tool", "name": "b", "content": "2"}], ["a", "b"]
            )
        history = [_PROBE_USER, _probe_assistant(["probe"]), result]
        prompt = self._render(history, add_generation_prompt=True)
        next_turn = _probe_assistant(["probe"])
        if self.opens_thinking():  # the model's turn then holds its reasoning, and so does the probe
            next_turn["reasoning_content"] = "The probe answered."
        continued = self._render([*history, next_turn])
        if continued[: len(prompt)] != prompt and not self._merges_at_the_boundary(prompt, continued):
            raise _not_prefix_preserving("appending an assistant turn after tool results re-renders the tool results")
        if self._tool_turn_ids(history, [result], ["probe"]) != first:
            raise _not_prefix_preserving("a second round's tool turn renders differently from the first round's")


    def opens_thinking(self) -> bool:
        """Whether the generation prompt opens a ``<think>`` block it does not close (Qwen3.5/3.6
        and Nemotron-3 with thinking): the model's turn then starts with its reasoning, which the
        template renders from ``reasoning_content`` in a past turn (a turn without it renders as
        an empty ``<think></think>``, not what the model wrote after ``<think>\n``)."""
        plain = self._render([_PROBE_USER], tokenize=False)
        opened = self._render([_PROBE_USER], add_generation_prompt=True, tokenize=False)
        tail = opened[len(plain):] if opened.startswith(plain) else opened
        return "<think>" in tail and "</think>" not in tail.split("<think>")[-1]

    def _merges_at_the_boundary(self, prompt: list[int], continued: list[int]) -> bool:
        """Whether ``continued`` renders the same text as ``prompt`` and only the generation
        prompt's last token is tokenized together with what follows (Qwen3.5's ``<think>\n`` then
        ``\n</think>``: one ``\n\n`` token). Generation starts after that token, so nothing the
        loop appends is re-rendered; a re-rendered earlier turn still fails the text comparison."""
        if len(prompt) < 2 or continued[: len(prompt) - 1] != prompt[:-1]:
            return False
        return self.tokenizer.decode(continued).startswith(self.tokenizer.decode(prompt))


def _first_row(ids: Any) -> list[int]:
    """The first row of a processor's ``input_ids`` ``(1, L)`` as a list."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def _not_prefix_preserving(what: str) -> TemplateError:
    return TemplateError(
        f"the chat template is not prefix-preserving: {what}, so the tokens of a tool turn cannot be appended to "
        "what the model generated without re-tokenizing the conversation. Known fixes exist for: "
        f"{', '.join(TEMPLATE_FIXES)}; for another model give a prefix-preserving template in data.agent.chat_template."
    )


def _fix_qwen3(template: str) -> str | None:
    """Qwen3: give every assistant turn after the last user query its ``<think>`` block, not
    only the last one (so a turn renders the same before and after a tool message follows it)."""
    clause = "{%- if loop.last or (not loop.last and reasoning_content) %}"
    if clause not in template:
        return None
    return template.replace(clause, "{%- if true %}", 1)


#: Family -> function from the model's template to its fixed training template (None: not that family).
TEMPLATE_FIXES: dict[str, Callable[[str], str | None]] = {"qwen3": _fix_qwen3, "deepseek-v3": fix_deepseek_v3}


def training_chat_template(
    tokenizer: Any, eos_token_ids: Sequence[int], chat_template_kwargs: Mapping[str, Any] | None = None,
    chat_template: str | None = None, max_calls_per_turn: int | None = None,
) -> ToolTurnTemplate:
    """The template the tool loop renders with, checked at start-up.

    ``chat_template`` (``data.agent.chat_template``) is used as given; otherwise the tokenizer's
    own if it is prefix-preserving, else the first known fix that applies to it and passes.

    Raises:
        TemplateError: No chat template, or none that is prefix-preserving.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            "tools need a chat template (to describe the tools and render tool results), and this tokenizer has "
            "none: use a chat/instruct model or set data.agent.chat_template."
        )
    candidate = ToolTurnTemplate(tokenizer, eos_token_ids, chat_template_kwargs, chat_template, max_calls_per_turn)
    try:
        candidate.check()
        return candidate
    except TemplateError as err:
        if chat_template is not None:
            raise
        first_error = err
    for fix in TEMPLATE_FIXES.values():
        fixed = fix(tokenizer.chat_template)
        if fixed is None:
            continue
        candidate = ToolTurnTemplate(tokenizer, eos_token_ids, chat_template_kwargs, fixed, max_calls_per_turn)
        candidate.check()
        return candidate
    raise first_error


__all__ = [
    "TEMPLATE_FIXES", "TemplateError", "ToolTurnTemplate", "image_blocks", "image_parts", "render_ids", "text_only",
    "training_chat_template",
]
