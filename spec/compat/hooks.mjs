// Module resolve hook for loading @cloudflare/sandbox in plain Node:
// `cloudflare:workers` (a scheme Node refuses) and `@cloudflare/containers`
// (whose build uses extension-less imports) resolve to the stubs beside
// this file.
const STUBS = {
  'cloudflare:workers': new URL('./workers-stub.mjs', import.meta.url).href,
  '@cloudflare/containers': new URL('./containers-stub.mjs', import.meta.url).href,
};

export async function resolve(specifier, context, nextResolve) {
  if (STUBS[specifier]) return { url: STUBS[specifier], shortCircuit: true };
  return nextResolve(specifier, context);
}
