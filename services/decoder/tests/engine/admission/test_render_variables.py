"""The variables a render sets itself: every global the sandbox gives a template is one, so no
template_kwargs key can shadow it."""

from __future__ import annotations

from tandem.decoder.engine.admission.render_variables import RENDER_VARIABLES
from tandem.decoder.engine.admission.template_sandbox import sandbox


def test_a_template_kwarg_may_not_shadow_a_global_the_sandbox_gives_every_template() -> None:
    # {"namespace": 1} on Qwen3's template (it calls namespace(...)) failed "'int' object is not
    # callable", named chat.chat_template: a template the caller never sent.
    assert set(sandbox().globals) <= set(RENDER_VARIABLES)
    assert "strftime_now" in RENDER_VARIABLES  # transformers' global: its templates test and call it
