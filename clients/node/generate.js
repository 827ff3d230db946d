#!/usr/bin/env node
// Streams one generation from a tandem decoder and prints the text as it arrives, then one JSON line:
//   {"finish_reason": "FINISH_REASON_LENGTH", "output_tokens": 16, "streamed_tokens": 16, ...}
// On an error status it prints {"error": {"code": "INVALID_ARGUMENT", "details": "..."}} to stderr
// and exits 1.
//
//   node generate.js ADDRESS PROMPT MAX_TOKENS [--embedding-rows N --hidden H] [--ignore-eos]
//                    [--temperature T] [--seed S] [--json-schema FILE | --regex RE | --choice A,B,...]
//                    [--adapter NAME]
//                    [--tls] [--tls-ca FILE] [--tls-cert FILE --tls-key FILE] [--auth-token-file FILE]
//
// ADDRESS is host:port, several host:port,host:port (balanced, health-checked) or dns:///name:port.
// --embedding-rows N --hidden H puts an embedding segment of N x H float32 zeros first in the
// prompt (H must be the model's hidden size; GetModelInfo reports it). An empty PROMPT sends no
// text segment. --json-schema, --regex and --choice constrain the answer (structured output).
// --adapter NAME generates with a LoRA adapter the decoder has loaded (GetModelInfo lists them).
"use strict";

const fs = require("node:fs");
const { securityFlags } = require("./client");
const { decoderClient, zeroEmbeddings, finishOnEnd } = require("./decoder");

function parseArgs(argv) {
  const positional = [];
  const options = {
    embeddingRows: 0, hidden: 0, ignoreEos: false, temperature: null, seed: null, structured: null, adapter: "",
  };
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    const value = () => {
      if (i + 1 >= argv.length) throw new Error(`${arg} needs a value`);
      return Number(argv[++i]);
    };
    if (arg === "--embedding-rows") options.embeddingRows = value();
    else if (arg === "--hidden") options.hidden = value();
    else if (arg === "--temperature") options.temperature = value();
    else if (arg === "--seed") options.seed = value();
    else if (arg === "--ignore-eos") options.ignoreEos = true;
    else if (arg === "--json-schema") options.structured = { json_schema: fs.readFileSync(argv[++i], "utf8") };
    else if (arg === "--regex") options.structured = { regex: argv[++i] };
    else if (arg === "--choice") options.structured = { choice: { choices: argv[++i].split(",") } };
    else if (arg === "--adapter") options.adapter = argv[++i];
    else positional.push(arg);
  }
  if (positional.length !== 3) {
    throw new Error("usage: node generate.js ADDRESS PROMPT MAX_TOKENS [--embedding-rows N --hidden H] ...");
  }
  const [address, prompt, maxTokens] = positional;
  return { address, prompt, maxTokens: Number(maxTokens), ...options };
}

function buildRequest(args) {
  const prompt = [];
  if (args.embeddingRows > 0) prompt.push(zeroEmbeddings(args.embeddingRows, args.hidden));
  if (args.prompt) prompt.push({ text: args.prompt });
  const sampling = {};
  if (args.temperature !== null) sampling.temperature = args.temperature;
  if (args.seed !== null) sampling.seed = args.seed;
  const request = {
    prompt,
    sampling,
    stopping: { max_new_tokens: args.maxTokens, ignore_eos: args.ignoreEos },
  };
  if (args.structured !== null) request.structured = args.structured;
  if (args.adapter) request.adapter = args.adapter;
  return request;
}

function main() {
  let args;
  let security;
  let client;
  try {
    const flags = securityFlags(process.argv.slice(2));
    security = flags.security;
    args = parseArgs(flags.rest);
    client = decoderClient(args.address, security);
  } catch (error) {
    console.error(error.message);
    process.exit(2);
  }
  const summary = { prompt_tokens: null, streamed_tokens: 0 };
  const call = client.Generate(buildRequest(args), { deadline: Date.now() + 120_000 });
  call.on("data", (response) => {
    if (response.event === "accepted") {
      summary.prompt_tokens = response.accepted.prompt_tokens;
    } else if (response.event === "delta") {
      summary.streamed_tokens += response.delta.token_ids.length;
      process.stdout.write(response.delta.text);
    } else if (response.event === "finished") {
      const finished = response.finished;
      summary.finish_reason = finished.reason;
      summary.output_tokens = finished.usage.output_tokens;
      summary.time_to_first_token_s = finished.time_to_first_token_s;
    }
  });
  finishOnEnd(call, client, summary);
}

main();
