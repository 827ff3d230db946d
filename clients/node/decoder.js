// The decoder's client and request helpers. The channel (TLS, bearer token, message limit, balancing
// over several servers) is client.js's; this module keeps what is the decoder's own.
"use strict";

// decoderClient(address, security): `security` from client.js `securityFromFiles`, plaintext without.
const { decoderClient, grpc, MAX_MESSAGE_BYTES } = require("./client");

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

module.exports = { decoderClient, zeroEmbeddings, grpc, MAX_MESSAGE_BYTES };
