// A stand-in for `@cloudflare/containers`, whose published build uses
// extension-less imports that Node's ESM loader refuses. The sandbox SDK
// extends Container and ContainerProxy at load time (a static
// `outboundHandlers` is assigned to a subclass) and calls getContainer /
// switchPort only on its Durable Object paths, never on SandboxClient's.
import { DurableObject } from './workers-stub.mjs';

export class Container extends DurableObject {}
export class ContainerProxy {}
export function getContainer() {
  throw new Error('getContainer: Durable Object path, not available in this test');
}
export function switchPort(request) {
  return request;
}
