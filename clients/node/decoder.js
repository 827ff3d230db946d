// The decoder's client and request helpers. The channel (TLS, bearer token, message limit, balancing
// over several servers) is client.js's; this module keeps what is the decoder's own.
"use strict";

// decoderClient(address, security): `security` from client.js `securityFromFiles`, plaintext without.
const { decoderClient, errorLine, grpc, MAX_MESSAGE_BYTES } = require("./client");

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

function nameOf(name, i) {
  if (typeof name !== "string") {
    throw new TypeError(`messages[${i}].name: must be a string, got ${typeof name}`);
  }
  return name;
}

// A turn's parts: [], null or no content at all is one part of empty text, as the gateway sends it (vLLM
// renders them so), where the decoder refuses a turn of no parts. Anything else but an array is refused
// in the gateway's words: false, 0 or a part object not in an array threw "content.map is not a function".
function contentParts(content, i) {
  if (typeof content === "string") return [content];
  if (content === undefined || content === null) return [""];
  if (!Array.isArray(content)) {
    throw new TypeError(
      `messages[${i}].content: must be a string or a list of content parts, got ${typeof content}`,
    );
  }
  return content.length === 0 ? [""] : content;
}

// A Generate request carrying a conversation, rendered with the model's chat template on the server.
// `messages` is [{role, content}] (and optionally name: "alice"), content a string or a list of parts
// ([], null or absent: empty text): a string (text), an array of token IDs, {embeddings: {dtype, shape,
// data}} (for example an encoder's output), or {image: tensor} (the encoder's rows for an image: the
// model's template places them).
function chatRequest(messages, { maxTokens = 256, addGenerationPrompt = true, temperature = null } = {}) {
  const part = (p) => {
    if (typeof p === "string") return { text: p };
    if (Array.isArray(p)) return { token_ids: { ids: p } };
    return p; // already {embeddings: ...}, {image: ...} or {text: ...}
  };
  const request = {
    chat: {
      messages: messages.map((m, i) => ({
        role: m.role,
        // The participant's name, for a template that prints it; unset without one, as the proto's
        // optional field means. Refused as the gateway refuses it: String() sent ["alice"] as "alice".
        ...(m.name === undefined || m.name === null ? {} : { name: nameOf(m.name, i) }),
        content: contentParts(m.content, i).map(part),
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
    console.error(errorLine(error));
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
