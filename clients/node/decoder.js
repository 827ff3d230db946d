// A tandem.v1.Decoder client built from the repository's protos at run time (no generated code,
// no copied .proto files): proto-loader reads protos/tandem/v1/decoder.proto and its imports.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS_ROOT = path.resolve(__dirname, "..", "..", "protos");
// Must match the servers' --max-message-bytes (common/channel.py DEFAULT_MAX_MESSAGE_BYTES).
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

const definition = protoLoader.loadSync("tandem/v1/decoder.proto", {
  includeDirs: [PROTOS_ROOT],
  keepCase: true, // field names as in the .proto: max_new_tokens, not maxNewTokens
  longs: Number,
  enums: String, // FINISH_REASON_LENGTH, not 1
  defaults: true,
  oneofs: true, // each GenerateResponse says which event it carries: response.event
});
const tandem = grpc.loadPackageDefinition(definition).tandem.v1;

function decoderClient(address) {
  return new tandem.Decoder(address, grpc.credentials.createInsecure(), {
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
  });
}

// An embedding segment of `rows` x `hidden` float32 zeros: little-endian, C-contiguous bytes.
function zeroEmbeddings(rows, hidden) {
  return {
    embeddings: {
      dtype: "DATA_TYPE_FLOAT32",
      shape: [rows, hidden],
      data: Buffer.alloc(rows * hidden * 4),
    },
  };
}

// A Generate request carrying a conversation, rendered with the model's chat template on the server.
// `messages` is [{role, content}], content a string or a list of parts: a string (text), an array of
// token IDs, or {embeddings: {dtype, shape, data}} (for example an encoder's output).
function chatRequest(messages, { maxTokens = 256, addGenerationPrompt = true, temperature = null } = {}) {
  const part = (p) => {
    if (typeof p === "string") return { text: p };
    if (Array.isArray(p)) return { token_ids: { ids: p } };
    return p; // already {embeddings: ...} or {text: ...}
  };
  const request = {
    chat: {
      messages: messages.map((m) => ({
        role: m.role,
        content: (typeof m.content === "string" ? [m.content] : m.content).map(part),
      })),
      add_generation_prompt: addGenerationPrompt,
    },
    stopping: { max_new_tokens: maxTokens },
  };
  if (temperature !== null) request.sampling = { temperature };
  return request;
}

// Ends a command-line stream: on an error status, {"error": {code, details}} to stderr and exit code 1;
// otherwise a newline after the streamed text and `summary` as one JSON line. Closes the client.
function finishOnEnd(call, client, summary) {
  let failed = false;
  call.on("error", (error) => {
    failed = true;
    const code = grpc.status[error.code] ?? String(error.code);
    console.error(JSON.stringify({ error: { code, details: error.details } }));
    client.close();
    process.exitCode = 1;
  });
  call.on("end", () => {
    if (failed) return; // grpc-js ends the stream after an error too
    process.stdout.write("\n" + JSON.stringify(summary) + "\n");
    client.close();
  });
}

module.exports = { decoderClient, zeroEmbeddings, chatRequest, finishOnEnd, grpc, MAX_MESSAGE_BYTES };
