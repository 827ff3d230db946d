"""The names Tandem records under: GenAI semantic conventions, Tandem's own attributes, metric buckets.

Plain constants, no OpenTelemetry import, so the client can name what it records without the SDK.
"""

# GenAI semantic conventions (Development status; open-telemetry/semantic-conventions docs/gen-ai).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
# Seconds from the request to its first output token: the client's view on a client span, arrival to
# first sampled token on the server's `text_completion` span.
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_EMBEDDINGS_DIMENSION_COUNT = "gen_ai.embeddings.dimension.count"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"  # "input" | "output", on gen_ai.client.token.usage
ERROR_TYPE = "error.type"
# The server a client span's call goes to (`tandem.client.addresses.server_of`); none for several.
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
# Tandem's own.
TANDEM_PROMPT_EMBEDDING_POSITIONS = "tandem.prompt.embedding_positions"  # prompt rows sent as embeddings
TANDEM_USAGE_CACHED_TOKENS = "tandem.usage.cached_tokens"  # prompt positions served by the prefix cache
TANDEM_WORLD_SIZE = "tandem.world_size"  # decoder ranks
TANDEM_TOKEN_KIND = "tandem.token.kind"  # on tandem.server.tokens: see TOKEN_KINDS
TANDEM_REQUEST_STATE = "tandem.request.state"  # "running" | "waiting" | "paused"
TANDEM_KV_BLOCK_STATE = "tandem.kv_block.state"  # "used" | "free"
# True on the gateway's HTTP server span of a request whose caller went away before its answer ended:
# not the server's failure, so the span's status stays unset (HTTP conventions: ERROR only for a 5xx).
# A request the gateway itself cut (its shutdown, its write timeout) has none: its span is ERROR.
TANDEM_CALLER_DISCONNECTED = "tandem.caller.disconnected"

PROVIDER = "tandem"
OPERATION_TEXT_COMPLETION = "text_completion"
OPERATION_EMBEDDINGS = "embeddings"
TOKEN_KINDS = ("prompt_token", "prompt_embedding", "output")

# Metrics. Durations in seconds; bucket advice from the GenAI metric conventions.
GEN_AI_SERVER_REQUEST_DURATION = "gen_ai.server.request.duration"
GEN_AI_SERVER_TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
GEN_AI_CLIENT_OPERATION_DURATION = "gen_ai.client.operation.duration"
GEN_AI_CLIENT_TOKEN_USAGE = "gen_ai.client.token.usage"
TANDEM_SERVER_TOKENS = "tandem.server.tokens"
TANDEM_SERVER_REJECTED = "tandem.server.requests.rejected"
TANDEM_ENGINE_REQUESTS = "tandem.engine.requests"
TANDEM_ENGINE_KV_BLOCKS = "tandem.engine.kv_cache.blocks"
TANDEM_ENGINE_PREFIX_CACHE_QUERY_TOKENS = "tandem.engine.prefix_cache.query_tokens"
TANDEM_ENGINE_PREFIX_CACHE_HIT_TOKENS = "tandem.engine.prefix_cache.hit_tokens"
TANDEM_ENGINE_SPECULATIVE_PROPOSED_TOKENS = "tandem.engine.speculative.proposed_tokens"
TANDEM_ENGINE_SPECULATIVE_ACCEPTED_TOKENS = "tandem.engine.speculative.accepted_tokens"

DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1 ... 67M
