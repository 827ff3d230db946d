"""The variables a chat template's render sets itself, which no template_kwargs key may name.

A render passes the template its messages, add_generation_prompt and the checkpoint's special token
names (`bos_token`, `eos_token`, ...), and the sandbox gives every template its globals
(template_sandbox.py). A kwarg named as one of them would replace it or fail the render as the
template's fault, so it is refused by name before anything is rendered (prompt.check_spec, and
chat.ChatTemplate.render for a render alone).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tandem.client.errors import InvalidArgument
from tandem.decoder.engine.admission.template_kwargs import FIELD as TEMPLATE_KWARGS
from tandem.decoder.engine.admission.template_kwargs import check_size

# The variables a render passes the template itself, besides the checkpoint's special tokens: a
# template_kwargs key of one of the first two reached Jinja2 twice and failed "generate() got multiple
# values for keyword argument", named as the template's fault; one named raise_exception replaced it.
# So would a key shadowing a global the sandbox gives every template (template_sandbox.sandbox: Jinja's
# own and raise_exception), which a template calls: {"namespace": 1} on Qwen3's template failed
# "'int' object is not callable", named chat.chat_template, a template the caller never sent; and
# transformers' strftime_now, which its templates (Llama 3.1's) call once `strftime_now is defined`.
# Filters and tests are namespaces of their own, which no variable shadows.
RENDER_VARIABLES = {
    "messages": "the chat's messages (chat.messages)",
    "add_generation_prompt": "chat.add_generation_prompt's; set that field",
    "raise_exception": "the function the sandbox gives every template",
    "strftime_now": "transformers' function, which templates written for it call",
    **{
        name: f"Jinja's global {name}(), which templates call"
        for name in ("range", "dict", "lipsum", "cycler", "joiner", "namespace")
    },
}


def check_template_kwargs(kwargs: dict[str, Any], special: Collection[str]) -> None:
    """Refuses kwargs past template_kwargs.MAX_KWARGS_CHARS, or one named as a variable the render
    sets itself (RENDER_VARIABLES, or one of the checkpoint's `special` token names), naming it and
    every name taken."""
    check_size(kwargs)
    # The kwargs' names are read (usually none), not the ~17 taken: the list is built for a refusal only.
    for name in kwargs:
        if name in RENDER_VARIABLES or name in special:
            own = RENDER_VARIABLES | {token: f"the checkpoint's {token}" for token in special}
            raise InvalidArgument(
                f"{TEMPLATE_KWARGS}.{name}",
                f"is the template's own variable, {own[name]}; a kwarg may not be named any of "
                f"{', '.join(sorted(own))}",
            )
