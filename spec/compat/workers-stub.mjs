// A stand-in for the Workers runtime module `cloudflare:workers`, enough to
// load @cloudflare/sandbox (and @cloudflare/containers) in plain Node: the
// classes they extend at load time, `tracing` undefined (the SDK reads it
// lazily and guards it), an empty `env`. Nothing here is called on the
// HTTP path that SandboxClient takes.
export class RpcTarget {}
export class DurableObject {
  constructor(ctx, env) {
    this.ctx = ctx;
    this.env = env;
  }
}
export class WorkerEntrypoint {
  constructor(ctx, env) {
    this.ctx = ctx;
    this.env = env;
  }
}
export const tracing = undefined;
export const env = {};
