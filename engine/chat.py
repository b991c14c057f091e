"""``--chat``: a user message (and ``--system`` message) rendered with the model's chat template, as
llama.cpp prepares a chat prompt.

The template is the GGUF's ``tokenizer.chat_template`` (kept in the pack's metadata.txt). It is
rendered with Jinja2 the way the Hugging Face convention does (transformers'
``chat_template_utils``, which llama-cpp-python's ``Jinja2ChatFormatter`` follows too): a sandboxed
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, the
``{% generation %}`` block (its body rendered as is, as transformers' ``AssistantTracker`` does), ``tojson``
as ``json.dumps`` without ASCII escaping, ``raise_exception`` and ``strftime_now``; the variables
``messages``, ``bos_token``, ``eos_token`` (the tokens' texts) and ``add_generation_prompt = true``.

Then as llama.cpp's ``common/chat.cpp`` (``common_chat_template_direct_apply_impl``): a leading BOS
text is removed when the model adds BOS itself, a trailing EOS text when it adds EOS; the result is
tokenized with special tokens parsed and BOS/EOS added as the model says
(:meth:`strata.engine.tokenizer.Tokenizer.encode`).
"""

from __future__ import annotations

import json
from datetime import datetime

from .errors import GenerateError
from .tokenizer import Tokenizer


class ChatTemplateError(GenerateError):
    """No chat template, or one that cannot be rendered (its own ``raise_exception`` message included)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _generation_extension():
    """Hugging Face's ``{% generation %} ... {% endgeneration %}`` block (transformers ``chat_template_utils``
    ``AssistantTracker``): it marks the assistant's tokens for ``return_assistant_tokens_mask`` and renders its
    body unchanged; strata renders the body (it never asks for the mask)."""
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)  # the "generation" name token
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def render_chat(
    template: str,
    messages: list[dict],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_bos: bool = False,
    add_eos: bool = False,
) -> str:
    """The prompt text of ``messages`` (``[{"role": ..., "content": ...}]``) under ``template``
    (module docstring). Raises ChatTemplateError for a template that does not parse or refuses."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        text = env.from_string(template).render(
            messages=messages, bos_token=bos_token, eos_token=eos_token, add_generation_prompt=True
        )
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"tokenizer.chat_template cannot be rendered: {type(e).__name__}: {e}") from None
    if add_bos and bos_token and text.startswith(bos_token):
        text = text[len(bos_token) :]
    if add_eos and eos_token and text.endswith(eos_token):
        text = text[: -len(eos_token)]
    return text


def chat_prompt(tok: Tokenizer, user: str, system: str | None = None, where: str = "the pack") -> str:
    """The prompt text for ``user`` (and ``system``) under the model's template (:func:`render_chat`).

    Raises:
        ChatTemplateError: the pack has no ``tokenizer.chat_template`` (a base model), or it refuses.
    """
    if not tok.chat_template:
        raise ChatTemplateError(
            f"{where} has no tokenizer.chat_template (a base model, not an instruct one?): "
            f"--chat needs the model's template; give the text with --prompt alone"
        )
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": user}
    ]
    bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
    eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
    return render_chat(
        tok.chat_template, messages, bos_token=bos, eos_token=eos, add_bos=tok.add_bos, add_eos=tok.add_eos
    )


__all__ = ["ChatTemplateError", "chat_prompt", "render_chat"]
