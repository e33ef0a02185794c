-- A development preset: generous limits, host network, no command timeout.
return {
  name = "dev",
  network = "host",
  limits = {
    maxOutputBytes = 64 * 1024 * 1024,
    maxLogBytes = 8 * 1024 * 1024,
    maxSessions = 256,
    maxProcesses = 1024,
    maxFileBytes = 256 * 1024 * 1024,
  },
}
