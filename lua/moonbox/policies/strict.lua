-- A strict preset: small, bounded, no host network (which needs namespaces:
-- with isolation "none" getSandbox refuses it).
return {
  name = "strict",
  network = "none",
  limits = {
    commandTimeoutMs = 30000,
    maxOutputBytes = 1024 * 1024,
    maxLogBytes = 256 * 1024,
    maxSessions = 8,
    maxProcesses = 16,
    killGraceMs = 2000,
    maxFileBytes = 8 * 1024 * 1024,
    memoryBytes = 512 * 1024 * 1024,
    pids = 256,
    cpuTime = 300,
    fileSizeBytes = 256 * 1024 * 1024,
    openFiles = 256,
  },
}
