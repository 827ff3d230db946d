#!/usr/bin/env node
// Asks a tandem decoder one chat question and streams the answer, then one JSON line:
//   {"finish_reason": "FINISH_REASON_EOS", "output_tokens": 9, ...}
// The server renders the conversation with the model's chat template; the template's end-of-turn
// token ends the answer. On an error status it prints {"error": {"code": ..., "details": ...}} to
// stderr and exits 1.
//
//   node chat.js ADDRESS QUESTION [--system TEXT] [--max-tokens N] [--temperature T]
//                [--image FILE --encoder ADDRESS]
//                [--tls] [--tls-ca PEM] [--tls-cert PEM --tls-key PEM] [--auth-token-file FILE]
//
// --image sends a picture (PNG, JPEG, WebP) to the encoder at --encoder first; its rows go into the
// question as an image part, which a LLaVA or SmolVLM checkpoint's template places.
"use strict";

const fs = require("node:fs");
const { encoderClient, errorLine, securityFlags } = require("./client");
const { decoderClient, chatRequest, finishOnEnd } = require("./decoder");

function parseArgs(argv) {
  const positional = [];
  const options = { system: null, maxTokens: 256, temperature: 0, image: null, encoder: "127.0.0.1:50051" };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${arg} needs a value`);
      return argv[++i];
    };
    if (arg === "--system") options.system = value();
    else if (arg === "--max-tokens") options.maxTokens = Number(value());
    else if (arg === "--temperature") options.temperature = Number(value());
    else if (arg === "--image") options.image = value();
    else if (arg === "--encoder") options.encoder = value();
    else positional.push(arg);
  }
  if (positional.length !== 2) {
    throw new Error("usage: node chat.js ADDRESS QUESTION [--system TEXT] [--max-tokens N] [--temperature T]");
  }
  return { address: positional[0], question: positional[1], ...options };
}

// The encoder's rows for the picture in `file`: resolves to the packed tensor.
function embedImage(address, security, file) {
  const client = encoderClient(address, security);
  return new Promise((resolve, reject) => {
    client.Embed({ image: { data: fs.readFileSync(file) } }, { deadline: Date.now() + 60_000 }, (error, reply) => {
      client.close();
      if (error) reject(error);
      else resolve(reply.embeddings);
    });
  });
}

async function main() {
  let args;
  let security;
  try {
    const flags = securityFlags(process.argv.slice(2));
    security = flags.security;
    args = parseArgs(flags.rest);
  } catch (error) {
    console.error(error.message);
    process.exit(2);
  }
  const messages = [];
  if (args.system !== null) messages.push({ role: "system", content: args.system });
  if (args.image === null) {
    messages.push({ role: "user", content: args.question });
  } else {
    let rows;
    try {
      rows = await embedImage(args.encoder, security, args.image);
    } catch (error) {
      console.error(error.code === undefined ? error.message : errorLine(error));
      process.exitCode = 1;
      return;
    }
    messages.push({ role: "user", content: [{ image: rows }, args.question] });
  }
  const request = chatRequest(messages, { maxTokens: args.maxTokens, temperature: args.temperature });
  const client = decoderClient(args.address, security);
  const summary = {};
  const call = client.Generate(request, { deadline: Date.now() + 120_000 });
  call.on("data", (response) => {
    if (response.event === "delta") {
      process.stdout.write(response.delta.text);
    } else if (response.event === "finished") {
      summary.finish_reason = response.finished.reason;
      summary.output_tokens = response.finished.usage.output_tokens;
      summary.prompt_tokens = response.finished.usage.input_tokens;
    }
  });
  finishOnEnd(call, client, summary);
}

main();
