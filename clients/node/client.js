// Clients for both services (tandem.v1.Decoder and tandem.v1.Encoder), built from the repository's
// protos at run time (no generated code, no copied .proto files), on channels that carry what the
// servers expect: the message-size limit, TLS (a CA to trust, a client certificate for mutual TLS)
// and a bearer token, as the Python client does (common/tandem/client/channel.py).
//
// An address is "host:port", several "host:port,host:port" (IP addresses or localhost), or
// "dns:///name:port" (every address a name resolves to, e.g. a Kubernetes headless Service). Several
// servers are balanced by grpc-js's round_robin with client-side health checking (health.js).
"use strict";

const fs = require("node:fs");
const net = require("node:net");
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const { POLICY } = require("./health");

const PROTOS_ROOT = path.resolve(__dirname, "..", "..", "protos");
// Must match the servers' --max-message-bytes (common/tandem/client/channel.py DEFAULT_MAX_MESSAGE_BYTES).
const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

const definition = protoLoader.loadSync(["tandem/v1/decoder.proto", "tandem/v1/encoder.proto"], {
  includeDirs: [PROTOS_ROOT],
  keepCase: true, // field names as in the .proto: max_new_tokens, not maxNewTokens
  longs: Number,
  enums: String, // FINISH_REASON_LENGTH, not 1
  defaults: true,
  oneofs: true, // each GenerateResponse says which event it carries: response.event
});
const tandem = grpc.loadPackageDefinition(definition).tandem.v1;

// The gRPC target of `address`, and whether it names several servers (then they are balanced).
function channelTarget(address) {
  const addresses = (Array.isArray(address) ? address : String(address).split(",")).map((a) => a.trim());
  if (addresses.length === 0 || addresses.some((a) => a === "")) {
    throw new Error(`address ${JSON.stringify(address)}: expected host:port, several separated by commas, or dns:///`);
  }
  if (addresses.length === 1) return { target: addresses[0], isBalanced: addresses[0].startsWith("dns:") };
  const hostPorts = addresses.map((a) => {
    const match = /^\[?([^\]]+?)\]?:(\d+)$/.exec(a);
    if (match === null) throw new Error(`address ${JSON.stringify(a)}: expected host:port`);
    const host = match[1] === "localhost" ? "127.0.0.1" : match[1];
    if (net.isIP(host) === 0) throw new Error(`address ${JSON.stringify(a)}: several servers are IP addresses; use dns:/// for a name`);
    return { host, port: match[2], family: net.isIP(host) };
  });
  const families = new Set(hostPorts.map((h) => h.family));
  if (families.size > 1) throw new Error(`address ${JSON.stringify(address)}: mixes IPv4 and IPv6 servers`);
  const scheme = families.has(4) ? "ipv4:" : "ipv6:";
  const list = hostPorts.map((h) => (h.family === 6 ? `[${h.host}]:${h.port}` : `${h.host}:${h.port}`));
  return { target: scheme + list.join(","), isBalanced: true };
}

// TLS and token from PEM and token files: {tls, tlsCa, tlsCert, tlsKey, authTokenFile} (all optional).
function securityFromFiles({ tls = false, tlsCa, tlsCert, tlsKey, authTokenFile } = {}) {
  const read = (file) => (file ? fs.readFileSync(file) : null);
  if (Boolean(tlsCert) !== Boolean(tlsKey)) throw new Error("a client certificate needs its private key, and the other way round");
  let token = null;
  if (authTokenFile) {
    token = fs.readFileSync(authTokenFile, "utf8").split("\n").map((l) => l.trim()).find((l) => l && !l.startsWith("#"));
    if (!token) throw new Error(`the auth token file ${authTokenFile} holds no token`);
  }
  return { isTls: tls || Boolean(tlsCa || tlsCert), ca: read(tlsCa), cert: read(tlsCert), key: read(tlsKey), token };
}

// Sends `authorization: Bearer <token>` with every call, over TLS or (on loopback) plaintext.
function bearerToken(token) {
  return (options, nextCall) =>
    new grpc.InterceptingCall(nextCall(options), {
      start(metadata, listener, next) {
        metadata.set("authorization", `Bearer ${token}`);
        next(metadata, listener);
      },
    });
}

function makeClient(Service, serviceName, address, security = {}) {
  const { target, isBalanced } = channelTarget(address);
  const credentials = security.isTls
    ? grpc.credentials.createSsl(security.ca ?? null, security.key ?? null, security.cert ?? null)
    : grpc.credentials.createInsecure();
  const options = {
    "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
    "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
  };
  if (isBalanced) {
    options["grpc.service_config"] = JSON.stringify({ loadBalancingConfig: [{ [POLICY]: { serviceName } }] });
  }
  if (security.token) options.interceptors = [bearerToken(security.token)];
  return new Service(target, credentials, options);
}

const decoderClient = (address, security) => makeClient(tandem.Decoder, "tandem.v1.Decoder", address, security);
const encoderClient = (address, security) => makeClient(tandem.Encoder, "tandem.v1.Encoder", address, security);

// Parses the flags every command shares: --tls, --tls-ca FILE, --tls-cert FILE, --tls-key FILE,
// --auth-token-file FILE. Returns the security and the arguments it did not take.
function securityFlags(argv) {
  const files = {};
  const rest = [];
  const names = { "--tls-ca": "tlsCa", "--tls-cert": "tlsCert", "--tls-key": "tlsKey", "--auth-token-file": "authTokenFile" };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--tls") files.tls = true;
    else if (argv[i] in names) {
      if (i + 1 >= argv.length) throw new Error(`${argv[i]} needs a file`);
      files[names[argv[i]]] = argv[++i];
    } else rest.push(argv[i]);
  }
  return { security: securityFromFiles(files), rest };
}

// A call's error as the one JSON line the command-line clients print to stderr.
function errorLine(error) {
  return JSON.stringify({ error: { code: grpc.status[error.code] ?? String(error.code), details: error.details } });
}

module.exports = {
  channelTarget,
  decoderClient,
  encoderClient,
  errorLine,
  grpc,
  MAX_MESSAGE_BYTES,
  securityFlags,
  securityFromFiles,
};
