#!/usr/bin/env node
// Asks a tandem encoder for the embeddings of a text (or of token IDs) and prints one JSON line:
//   {"shape": [4, 576], "dtype": "DATA_TYPE_BFLOAT16", "token_ids": [...], "input_tokens": 4,
//    "first_row": [0.0123, ...]}   (first_row: the first 8 values, decoded from the tensor's bytes)
// On an error status it prints {"error": {"code": ..., "details": ...}} to stderr and exits 1.
//
//   node embed.js ADDRESS TEXT [--ids 1,2,3] [--dtype float32|bfloat16|float16]
//                 [--tls] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE] [--auth-token-file FILE]
//
// --ids embeds those token IDs instead of TEXT (then pass "" as TEXT).
"use strict";

const { encoderClient, errorLine, securityFlags } = require("./client");

function parseArgs(argv) {
  const positional = [];
  const options = { ids: null, dtype: null };
  for (let i = 0; i < argv.length; i++) {
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${argv[i]} needs a value`);
      return argv[++i];
    };
    if (argv[i] === "--ids") options.ids = value().split(",").map(Number);
    else if (argv[i] === "--dtype") options.dtype = value();
    else positional.push(argv[i]);
  }
  if (positional.length !== 2) throw new Error("usage: node embed.js ADDRESS TEXT [--ids 1,2,3] [--dtype D] ...");
  if (options.ids !== null && options.ids.some((id) => !Number.isInteger(id) || id < 0)) {
    throw new Error("--ids: comma-separated token IDs, e.g. 1,2,3");
  }
  return { address: positional[0], text: positional[1], ...options };
}

// The tensor's values: little-endian floats; bfloat16 is the upper half of a float32.
function values(tensor, count) {
  const data = tensor.data;
  const out = [];
  for (let i = 0; i < Math.min(count, data.length / (tensor.dtype === "DATA_TYPE_FLOAT32" ? 4 : 2)); i++) {
    if (tensor.dtype === "DATA_TYPE_FLOAT32") out.push(data.readFloatLE(4 * i));
    else if (tensor.dtype === "DATA_TYPE_BFLOAT16") out.push(Buffer.from([0, 0, data[2 * i], data[2 * i + 1]]).readFloatLE(0));
    else out.push(halfToFloat(data.readUInt16LE(2 * i)));
  }
  return out;
}

function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * 2 ** -14 * (fraction / 1024);
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * 2 ** (exponent - 15) * (1 + fraction / 1024);
}

function main() {
  let args;
  let client;
  try {
    const { security, rest } = securityFlags(process.argv.slice(2));
    args = parseArgs(rest);
    client = encoderClient(args.address, security);
  } catch (error) {
    console.error(error.message);
    process.exit(2);
  }
  const request = args.ids !== null ? { token_ids: { ids: args.ids } } : { text: args.text };
  if (args.dtype !== null) request.output_dtype = `DATA_TYPE_${args.dtype.toUpperCase()}`;
  client.Embed(request, { deadline: Date.now() + 60_000 }, (error, response) => {
    client.close();
    if (error) {
      console.error(errorLine(error));
      process.exitCode = 1;
      return;
    }
    const tensor = response.embeddings;
    const summary = {
      shape: tensor.shape,
      dtype: tensor.dtype,
      token_ids: response.token_ids.ids,
      input_tokens: response.usage.input_tokens,
      first_row: values(tensor, 8),
    };
    process.stdout.write(JSON.stringify(summary) + "\n");
  });
}

main();
