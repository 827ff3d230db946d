"""llguidance's parser limits on one grammar: how much its lexer may build, before and while decoding.

Each matcher a request gets (structured.py) is built under these, and the refusals they cause are said
in our words by grammar_messages.py. Each bound is where its measurement put it (the comments).
"""

# The work llguidance's lexer may do to build a grammar's regular expressions before its first mask
# (its initial_lexer_fuel; llguidance's default is 1,000,000). At the default the 13 bytes
# `a{1000}{1000}` cost 0.8-2.5 s of CPU per request to build and take their first mask, and the
# exhausted fuel showed only when the first token was taken, mid-stream. Measured with SmolLM2's
# vocabulary on a busy 2-core machine: that regex fails in 94 ms at this bound (31 ms at 100,000);
# JSON schemas (formats, 2,000 properties, 500 patterned anyOf), 1,024 choices, `\w{1,1000}` and
# `a{300}{100}` (30,000 characters) need under 100,000, but the deepest $ref chain within
# structured.MAX_SOURCE_CHARS (1,716 levels) needs between 100,000 and 150,000.
MAX_LEXER_FUEL = 200_000
# The lexer states one matcher may build while decoding (llguidance's max_lexer_states; its default is
# 250,000). States are built as an answer goes on and kept until the request ends: a matcher starts at
# grammar_growth.FIRST_MAX_LEXER_STATES and is charged as it grows (grammar_growth.py), up to this, about
# 50 MB (`[\w .]{1,1000}` reached it after 1,156-1,301 random one-character tokens, 47 MB at 700).
# Measured with SmolLM2's vocabulary: 300 random tokens of `json_object` and of
# bench/structured_output.py's schema need under 500 states, and at 5,000 every structured test passes
# but one (`a{1000}{1000}` is then refused for its states before its fuel); this is 10 times that. The
# memory a build takes (`a{300}{190}`'s 20 MB) is the lexer fuel's to bound, and grammar_memory's to
# count.
MAX_LEXER_STATES = 50_000
# llguidance's bound on a compiled grammar's size (its max_grammar_size, left at its default).
MAX_GRAMMAR_SIZE = 500_000
