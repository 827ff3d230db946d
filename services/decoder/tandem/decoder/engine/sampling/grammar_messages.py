"""llguidance's messages said in ours: its markers and backtraces left out, the limits it hit named.

A grammar refused when built (structured.py) and one that fails mid-answer (constraint.py) tell the
caller the same words for the same cause; what llguidance says of a limit names neither the limit nor
what passed it, so where we recognise one we say both.
"""

from __future__ import annotations

import logging

from tandem.decoder.engine.sampling.grammar_limits import MAX_GRAMMAR_SIZE, MAX_LEXER_FUEL

log = logging.getLogger(__name__)


def llguidance_reason(message: str) -> str:
    """llguidance's error, less its markers ('<non-verbose/>', under verbose_errors=False) and its
    empty words ('no error message'): what is left, if anything, says something. A panic's is its
    first line: its backtrace (frames, and llguidance's build paths) is logged, not told the client
    (`start: w "x"`, `w[lazy]: /[\\w .]{0,1000}/` panics on its first mask)."""
    if "<backtrace>" in message:
        message, _, backtrace = message.partition("<backtrace>")
        log.warning("llguidance failed: %s; its backtrace: %s", message.strip(), backtrace.strip())
    text = short(message.replace("<non-verbose/>", "").replace("no error message", ""))
    return text.strip(" ;:,.")


def in_our_words(reason: str) -> str | None:
    """llguidance's reason for a limit it hit, said as what it means for the grammar, or None."""
    if "too many expressions constructed" in reason:
        return (
            f"is too complex: building its regular expressions takes more than the {MAX_LEXER_FUEL:,} "
            "steps the grammar compiler allows (its lexer fuel; nested counts such as a{1000}{1000} "
            "spell out a million characters)"
        )
    if "schema too large" in reason:
        # llguidance's words alone named neither the limit nor what passed it. It is its JSON schema
        # compiler's own bound on the schemas it builds (allOf of anyOf multiply out: 4 allOf of 10
        # anyOf each, 3.5 KB, pass it, 3 do not), not max_grammar_size: at 100 times that the same
        # schema is refused the same way.
        return (
            "is too large: compiling it builds more than llguidance's JSON schema compiler allows (a "
            "fixed bound, apart from its max_grammar_size of "
            f"{MAX_GRAMMAR_SIZE:,}); each allOf of anyOf multiplies the alternatives to build"
        )
    if "too many states" in reason:
        return f"is too complex: its regular expressions need more lexer states than allowed ({reason})"
    if "Too many items" in reason and "ff_tokens" in reason:
        # Text the grammar forces, token by token, ran past the parser's items: a rule that requires
        # itself (a required property whose schema is its own) forces text that never ends.
        return (
            "admits no finite answer: the text it forces never ends (a rule that requires itself, "
            f"such as a required property whose schema is its own) ({reason})"
        )
    if "Current row has" in reason:
        return f"offers more alternatives at one point than the parser follows ({reason})"
    return None


def short(message: str) -> str:
    return " ".join(message.split())[:300]
