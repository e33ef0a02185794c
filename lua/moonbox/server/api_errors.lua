-- Error responses of the HTTP API: {code, message, context, httpStatus}
-- with the status the seed's SDK gives that code (its shared status map),
-- and the codes moonbox adds placed beside their nearest kin. Anything that
-- is not an error table of ours is a bug: 500 INTERNAL_ERROR, logged.
local errors = require "moonbox.errors"

local M = {}

M.STATUS = {
  -- 400: the request itself is wrong
  VALIDATION_FAILED = 400, IS_DIRECTORY = 400, NOT_DIRECTORY = 400, INVALID_GIT_URL = 400,
  INVALID_BACKUP_CONFIG = 400, BACKUP_EXPIRED = 400, IMAGE_INVALID = 400,
  -- 401
  GIT_AUTH_FAILED = 401, UNAUTHORIZED = 401,
  -- 403: not allowed
  POLICY_DENIED = 403, PERMISSION_DENIED = 403, PATH_OUTSIDE_SANDBOX = 403,
  -- 404
  NOT_FOUND = 404, SANDBOX_NOT_FOUND = 404, PORT_NOT_EXPOSED = 404, SESSION_NOT_FOUND = 404, FILE_NOT_FOUND = 404,
  PROCESS_NOT_FOUND = 404, IMAGE_NOT_FOUND = 404,
  CONTEXT_NOT_FOUND = 404, GIT_REPOSITORY_NOT_FOUND = 404, GIT_BRANCH_NOT_FOUND = 404, BACKUP_NOT_FOUND = 404,
  -- 405
  METHOD_NOT_ALLOWED = 405,
  -- 408: a wait ran out of time
  PROCESS_READY_TIMEOUT = 408, TIMEOUT = 408,
  -- 409: the state of a resource conflicts with the call
  SESSION_ALREADY_EXISTS = 409, FILE_EXISTS = 409, PROCESS_ALREADY_EXISTS = 409, CONTEXT_ALREADY_EXISTS = 409,
  SESSION_DESTROYED = 409, SANDBOX_DESTROYED = 409,
  TERMINAL_CLOSED = 409, PROCESS_EXITED_BEFORE_READY = 409,
  SANDBOX_IN_USE = 409, -- another runtime holds the sandbox's root
  PORT_ALREADY_EXPOSED = 409,
  -- 499: the client went away (nginx's "client closed request"); nobody reads it
  CANCELLED = 499,
  -- 413
  FILE_TOO_LARGE = 413, REQUEST_TOO_LARGE = 413,
  -- 500: the runtime failed
  INTERNAL_ERROR = 500, FILESYSTEM_ERROR = 500, SHELL_START_FAILED = 500, GIT_CLONE_FAILED = 500,
  DEADLOCK = 500, NOT_IN_TASK = 500, BACKUP_CREATE_FAILED = 500, BACKUP_RESTORE_FAILED = 500,
  POLICY_ERROR = 500, -- a policy hook threw or returned a wrong type; the message names the hook
  -- 501: this host or build cannot do it (lasting: retrying does not help, so not 503)
  INTERPRETER_NOT_AVAILABLE = 501, ISOLATION_UNAVAILABLE = 501, SECCOMP_UNAVAILABLE = 501,
  -- 502: something beyond the sandbox failed
  GIT_NETWORK_ERROR = 502, IMAGE_PULL_FAILED = 502,
  -- 503: the sandbox's init died and the sandbox was rebuilt over its
  -- workspace: the call that was running is lost, the same call again works
  SANDBOX_RESTARTED = 503,
  -- 503: the server's send budget (--max-buffered-bytes) is spent; retry later
  BUFFERS_FULL = 503,
  -- 507
  NO_SPACE = 507,
}

function M.status(code)
  return M.STATUS[code] or 500
end

-- A failure of the moment: the runtime out of fds, memory or processes.
-- Whatever the code (ISOLATION_UNAVAILABLE, SHELL_START_FAILED, ...), its
-- status is 503, which clients retry, not a lasting 501 or a 500.
M.TRANSIENT_ERRNO = { EMFILE = true, ENFILE = true, ENOMEM = true, EAGAIN = true }

-- The code of a bug (anything raised that is not an error table of ours).
M.INTERNAL = "INTERNAL_ERROR"

-- envelope(code, message[, context[, status]]) -> {code, message, context,
-- httpStatus}: the one shape of every error body the servers send (HTTP
-- responses, SSE and WebSocket error events); status defaults to the code's.
function M.envelope(code, message, context, status)
  return { code = code, message = message, context = context or {}, httpStatus = status or M.status(code) }
end

-- body(err) -> status, {code, message, context, httpStatus}
function M.body(err)
  if not errors.is_error(err) then
    io.stderr:write("moonbox api: internal error: ", errors.format(err), "\n")
    return 500, M.envelope(M.INTERNAL, "internal error", {}, 500)
  end
  local status = M.status(err.code)
  if status >= 500 and type(err.context) == "table" and M.TRANSIENT_ERRNO[err.context.errno] then status = 503 end
  if status == 500 and err.code ~= "FILESYSTEM_ERROR" and err.code ~= "GIT_CLONE_FAILED" then
    io.stderr:write("moonbox api: ", errors.format(err), "\n")
  end
  return status, M.envelope(err.code, err.message, err.context, status)
end

return M
