// Client-side health checking for grpc-js, which has round_robin but not gRPC's A17 health checks.
//
// The policy "tandem_health_round_robin" is grpc-js's own round_robin over subchannels that each
// watch grpc.health.v1 for one service on their own connection (`subchannel.getChannel()`, as
// grpc-js's ORCA support does). As in gRPC's C core, health is folded into the subchannel's state:
// a connection is READY to round_robin only once its server says SERVING, CONNECTING until the first
// answer (calls wait rather than fail), TRANSIENT_FAILURE while the server says anything else. So a
// replica that loads, drains or fails gets no new calls. Built only on `grpc.experimental`, the API
// grpc-js exports for load-balancing policies; the version is pinned by package-lock.json.
"use strict";

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const POLICY = "tandem_health_round_robin";
const RETRY_MS = 1000; // a failed Watch on a READY connection is asked again after this long

// grpc.health.v1, as a protobuf.js JSON descriptor: the two messages and the service it needs.
const HEALTH = protoLoader.fromJSON(
  {
    nested: {
      grpc: { nested: { health: { nested: { v1: { nested: {
        HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
        HealthCheckResponse: {
          fields: { status: { type: "ServingStatus", id: 1 } },
          nested: { ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } } },
        },
        Health: {
          methods: {
            Check: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse" },
            Watch: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse", responseStream: true },
          },
        },
      } } } } } },
    },
  },
  { enums: String },
);
const HealthClient = grpc.loadPackageDefinition(HEALTH).grpc.health.v1.Health;

const { READY, CONNECTING, TRANSIENT_FAILURE } = grpc.connectivityState;

class HealthWatchedSubchannel extends grpc.experimental.BaseSubchannelWrapper {
  constructor(child, serviceName) {
    super(child);
    this.serviceName = serviceName;
    this.status = null; // the server's last answer ("SERVING", ...); null before the first
    this.call = null;
    this.retry = null;
    this.listeners = new Set();
    this.keepaliveTime = -1;
    this.reported = this.getConnectivityState();
    this.onChildState = (_subchannel, _previous, _state, keepaliveTime, errorMessage) => {
      this.keepaliveTime = keepaliveTime;
      this.follow(errorMessage);
    };
    child.addConnectivityStateListener(this.onChildState);
    this.follow();
  }

  getConnectivityState() {
    const state = this.child.getConnectivityState();
    if (state !== READY) return state;
    if (this.status === "SERVING") return READY;
    return this.status === null ? CONNECTING : TRANSIENT_FAILURE;
  }

  addConnectivityStateListener(listener) {
    this.listeners.add(listener);
  }

  removeConnectivityStateListener(listener) {
    this.listeners.delete(listener);
  }

  follow(errorMessage) {
    if (this.child.getConnectivityState() === READY) {
      if (this.call === null && this.retry === null) this.watch();
    } else {
      this.stopWatching();
      this.status = null;
    }
    this.report(errorMessage);
  }

  report(errorMessage) {
    const state = this.getConnectivityState();
    if (state === this.reported) return;
    const previous = this.reported;
    this.reported = state;
    const why = errorMessage ?? `grpc.health.v1 says ${this.status} for ${this.serviceName}`;
    for (const listener of [...this.listeners]) listener(this, previous, state, this.keepaliveTime, why);
  }

  watch() {
    const client = new HealthClient("unused", grpc.credentials.createInsecure(), {
      channelOverride: this.getChannel(), // this connection, with its own TLS
    });
    const call = client.Watch({ service: this.serviceName });
    this.call = call;
    call.on("data", (response) => {
      this.status = response.status;
      this.report();
    });
    call.on("error", (error) => {
      if (this.call !== call) return; // cancelled by stopWatching
      this.call = null;
      // A17: a server without the health service is not health-checked; any other failure counts as
      // not serving until a new Watch says otherwise.
      this.status = error.code === grpc.status.UNIMPLEMENTED ? "SERVING" : grpc.status[error.code];
      this.report();
      if (error.code !== grpc.status.UNIMPLEMENTED) {
        this.retry = setTimeout(() => {
          this.retry = null;
          this.follow();
        }, RETRY_MS);
        this.retry.unref();
      }
    });
  }

  stopWatching() {
    if (this.retry !== null) clearTimeout(this.retry);
    this.retry = null;
    const call = this.call;
    this.call = null;
    if (call !== null) call.cancel();
  }

  destroy() {
    this.stopWatching();
    this.child.removeConnectivityStateListener(this.onChildState);
    super.destroy();
  }
}

class HealthRoundRobinConfig {
  constructor(serviceName) {
    this.serviceName = serviceName;
  }

  getLoadBalancerName() {
    return POLICY;
  }

  toJsonObject() {
    return { [POLICY]: { serviceName: this.serviceName } };
  }

  static createFromJson(json) {
    return new HealthRoundRobinConfig(typeof json.serviceName === "string" ? json.serviceName : "");
  }
}

class HealthRoundRobin {
  constructor(channelControlHelper) {
    this.serviceName = "";
    const helper = grpc.experimental.createChildChannelControlHelper(channelControlHelper, {
      createSubchannel: (address, options) =>
        new HealthWatchedSubchannel(channelControlHelper.createSubchannel(address, options), this.serviceName),
    });
    this.child = new grpc.experimental.ChildLoadBalancerHandler(helper);
  }

  updateAddressList(endpointList, lbConfig, options, resolutionNote) {
    if (!(lbConfig instanceof HealthRoundRobinConfig)) return false;
    this.serviceName = lbConfig.serviceName;
    const roundRobin = grpc.experimental.parseLoadBalancingConfig({ round_robin: {} });
    return this.child.updateAddressList(endpointList, roundRobin, options, resolutionNote);
  }

  exitIdle() {
    this.child.exitIdle();
  }

  resetBackoff() {
    this.child.resetBackoff();
  }

  destroy() {
    this.child.destroy();
  }

  getTypeName() {
    return POLICY;
  }
}

grpc.experimental.registerLoadBalancerType(POLICY, HealthRoundRobin, HealthRoundRobinConfig);

module.exports = { POLICY, HealthClient };
