---@meta
-- Type annotations of moonbox's public Lua API for lua-language-server
-- (completion of `sb:exec(` and its options, hover docs, type checks). A
-- definition file only: nothing here runs, and `require "moonbox"` never
-- loads it. It is installed beside the modules; point the language server at
-- the Lua directory (`"workspace.library": ["/usr/share/lua/5.1"]` in
-- .luarc.json, or the checkout's `lua/`). Reference: docs/api.md, whose call
-- names spec/types_spec.lua checks against this file.
-- luacheck: ignore

------------------------------------------------------------------------
-- Errors
------------------------------------------------------------------------

---An error raised by moonbox: a table (tostring gives "CODE: message").
---@class MoonboxError
---@field code string e.g. "VALIDATION_FAILED", "SESSION_NOT_FOUND", "TIMEOUT"
---@field message string
---@field context table

------------------------------------------------------------------------
-- The module
------------------------------------------------------------------------

---@class moonbox
---@field policies table<string, Policy> the presets by name: `moonbox.policies.strict`, `moonbox.policies.dev`
local moonbox = {}

---Run fn as a task and drive the loop until every task has finished; inside a task, run fn as a sub-task and wait.
---@param fn fun(...): ...
---@param ... any arguments for fn
---@return any ... fn's results (its error is re-raised)
function moonbox.run(fn, ...) end

---Start a task at once.
---@param fn fun(...): ...
---@param ... any
---@return Task
function moonbox.spawn(fn, ...) end

---Run functions concurrently (waits); their first results in order; the first error is raised after all settle.
---@param ... (fun(): any)|(fun(): any)[] functions, or one array of them
---@return any[]
function moonbox.all(...) end

---Yield the calling task for ms milliseconds (waits).
---@param ms number
function moonbox.sleep(ms) end

---Run fn; raise TIMEOUT and cancel it after ms (waits).
---@param ms number
---@param fn fun(...): ...
---@param ... any
---@return any ...
function moonbox.timeout(ms, fn, ...) end

---The sandbox with this id (the same object for the same id). id: 1-63 of [a-z0-9_-], not starting or ending with "-".
---@param id string
---@param opts? SandboxOptions
---@return Sandbox
function moonbox.getSandbox(id, opts) end

---The image store (docs/images.md).
moonbox.images = {}
---Import an image: oci:DIR[:TAG], docker-archive:FILE or REGISTRY/NAME[:TAG|@sha256:...]. Waits.
---@param ref string
---@param opts? ImagePullOptions
---@return ImageRecord
function moonbox.images.pull(ref, opts) end
---@return ImageRecord[]
function moonbox.images.list() end
---Remove a name, and the layers no other image uses. Waits.
---@param name string
---@return {success: boolean, name: string, removedLayers: integer}
function moonbox.images.remove(name) end
---@param ref string a name or a digest
---@return ImageRecord?
function moonbox.images.get(ref) end

---The stored backups, oldest first.
---@return Backup[]
function moonbox.listBackups() end

---Remove a stored backup.
---@param id string
---@return {success: boolean, id: string}
function moonbox.deleteBackup(id) end

---Keep a pool of up to n (0-16; true: 1) namespaced sandboxes built ahead for the next getSandbox calls
---(off by default; false or 0 drops them).
---@param n boolean|integer
function moonbox.prewarm(n) end

---Whether session shells run plain commands through their spawn builtin (`spawn`) and load their
---builtins at all (`load`); both on by default. Returns the settings in force (docs/sessions.md).
---@param opts? {spawn?: boolean, load?: boolean}
---@return {spawn: boolean, load: boolean}
function moonbox.shellBuiltins(opts) end

---Run the runtime's loop once without blocking (outside tasks only); the number of tasks still running.
---@return integer
function moonbox.step() end

---What to wait on between two step() calls: the loop's fd (readable when there is work) and the ms until its next timer (-1: none).
---@return integer fd
---@return integer timeout_ms
function moonbox.backend() end

---The number of running tasks.
---@return integer
function moonbox.pending() end

---Versions of moonbox and the libraries it runs on.
---@return table<string, string>
function moonbox.versions() end

---A task (a coroutine on the runtime's loop).
---@class Task
local Task = {}

---Wait for the task (waits); its results, or its error re-raised.
---@return any ...
function Task:wait() end

---Cancel the task: the pending operation's cleanup runs and CANCELLED is raised inside it.
function Task:cancel() end

---"running", "cancelling", "ok" (finished) or "error" (raised).
---@return "running"|"cancelling"|"ok"|"error"
function Task:status() end

------------------------------------------------------------------------
-- Sandboxes
------------------------------------------------------------------------

---@alias Isolation "auto"|"namespaces"|"none"
---@alias Network "none"|"host"|"egress"

---@class SandboxOptions
---@field root? string host directory of the sandbox (default `$MOONBOX_HOME/sandboxes/<id>`)
---@field isolation? Isolation default "auto": namespaces where the kernel allows
---@field network? Network "none" (default under namespaces), "host", or "egress" (docs/network.md)
---@field egress? EgressRules the rules of network = "egress"
---@field env? table<string, string|false> sandbox-level variables (`false`: unset)
---@field policy? Policy|string a policy table, a preset or module name, or a file path
---@field limits? Limits
---@field from? Backup|string start a new sandbox from a backup (or its id)
---@field image? string the root is made of this image: a stored name or digest, oci:DIR[:TAG], docker-archive:FILE
---or REGISTRY/NAME[:TAG] (docs/images.md)

---@class ImageRecord
---@field name string
---@field source string the reference it was pulled from ("commit:<sandbox id>" for a template)
---@field digest string sha256 of its config (the image id)
---@field manifest? string
---@field parent? string a committed image's: the image it came from
---@field layers string[] layer blob digests' hex, bottom first
---@field size number
---@field config {Env: string[], Entrypoint?: string[], Cmd?: string[], WorkingDir?: string, User?: string}
---@field created? string
---@field pulledAt string

---@class ImagePullOptions
---@field name? string the name to store it under (default: the reference)
---@field onProgress? fun(ev: {type: "layer"|"progress"|"layerDone", index: integer, count: integer, digest?: string, bytes?: number, entries?: number, cached?: boolean})

---@class EgressRules
---@field allow? string[] CIDRs, "cidr:port", domain names (with their subdomains), "name:port"
---@field deny? string[] the same; deny wins over allow

---@class EgressInfo
---@field mode "egress"
---@field mechanism "veth+nftables"
---@field address string the sandbox's IPv4 address
---@field gateway string the host's side of its link
---@field resolver string its DNS resolver
---@field link string the host's side of its veth (mbx<n>)
---@field table string its nftables table ("inet mbx_<n>_<id>")
---@field ipv6 "dropped"
---@field egress {allow: string[], deny: string[]}
---@field limits {connections?: integer, egressBytesPerSecond?: integer}
---@field counters {sentBytes: integer, sentPackets: integer, receivedBytes: integer, receivedPackets: integer, refusedPackets: integer}

---@class SandboxInfo
---@field id string
---@field root string
---@field isolation "namespaces"|"none" what is in force
---@field requestedIsolation Isolation
---@field isolationError? string why "auto" runs without namespaces
---@field network "none"|"host"|EgressInfo
---@field namespaces string[] e.g. {"user", "mnt", "pid", "ipc", "uts", "net"}
---@field initPid? integer
---@field restarts integer
---@field cgroup "v2"|"v1"|"none"
---@field killMode "cgroup"|"proc"
---@field limits Limits
---@field enforcement table<string, string>
---@field notEnforced string[] limits this host cannot enforce
---@field seccomp string
---@field noNewPrivs boolean
---@field idmap {uid: integer, gid: integer, count: integer}
---@field capabilities? string[]
---@field openFiles {soft: number, hard: number, open: integer?} the runtime's RLIMIT_NOFILE and fds open (math.huge: unlimited)

---@class DestroyOptions
---@field keepFiles? boolean keep the root on disk

---@class SessionOptions
---@field id? string default `session-<n>`; [A-Za-z0-9_.-], 1-128
---@field env? table<string, string|false>
---@field cwd? string default "/workspace"; must exist
---@field commandTimeoutMs? number default timeout of the session's exec calls

---@class DeleteSessionResult
---@field success boolean
---@field sessionId string
---@field timestamp string

---@class EnvResult
---@field success boolean
---@field sessionId? string
---@field timestamp string

---The calls every session has; a sandbox has them too, bound to its default session.
---@class SessionMethods
local SessionMethods = {}

---A sandbox: a directory (under namespaces, its own view of the machine) holding sessions.
---@class Sandbox: SessionMethods
---@field id string
---@field root string
---@field idmap {uid: integer, gid: integer, count: integer}
local Sandbox = {}

---What is in force (isolation, limits, cgroup, seccomp).
---@return SandboxInfo
function Sandbox:info() end

---An egress sandbox's rules, replaced at once for new connections (one nftables transaction).
---@param opts {network?: "egress", egress?: EgressRules}
---@return EgressInfo
function Sandbox:setNetwork(opts) end

---Kill every process of the sandbox, forget its sessions, remove its root unless keepFiles (waits).
---@param opts? DestroyOptions
function Sandbox:destroy(opts) end

---Start a session (a persistent shell) at once.
---@param opts? SessionOptions
---@return Session
function Sandbox:createSession(opts) end

---The live session with this id (SESSION_NOT_FOUND otherwise).
---@param id string
---@return Session
function Sandbox:getSession(id) end

---Kill the session's shell and every process it started (waits until none is left); "default" resets the default session.
---@param id string
---@return DeleteSessionResult
function Sandbox:deleteSession(id) end

---The live sessions' ids, sorted.
---@return string[]
function Sandbox:listSessions() end

---Variables for the default session now and for sessions created later (`false` unsets; waits).
---@param map table<string, string|false>
---@return EnvResult
function Sandbox:setEnvVars(map) end

---@class BackupOptions
---@field dir string absolute path in the sandbox's view
---@field name? string
---@field excludes? string[] mksquashfs wildcard patterns relative to dir
---@field gitignore? boolean refused: list the names in excludes
---@field ttl? number seconds (default 259200)
---@field compression? "zstd"|"gzip"|"lz4"|"xz"|"lzo"

---@class Backup
---@field id string
---@field dir string
---@field name? string
---@field sandboxId string
---@field sizeBytes integer
---@field compression string
---@field createdAt string
---@field expiresAt string

---@class RestoreResult
---@field success boolean
---@field dir string
---@field id string

---What this sandbox (made from an image) changed over its image, as a new image in the store. Waits.
---@param opts {name: string}
---@return ImageRecord
function Sandbox:commit(opts) end

---A squashfs archive of dir, stored under the runtime's home (waits).
---@param opts BackupOptions
---@return Backup
function Sandbox:createBackup(opts) end

---Make the backup's dir (or the given one) exactly the backup's content (waits).
---@param backup Backup|string a backup or its id
---@return RestoreResult
function Sandbox:restoreBackup(backup) end

---@class ExposePortOptions
---@field name? string
---@field public? boolean the proxy takes no token for this port

---@class ExposedPort
---@field url string `http://{port}-{id}.localhost:<serve port>/`
---@field port integer
---@field name? string
---@field public boolean
---@field exposedAt string

---Make a port inside the sandbox reachable through `moonbox serve`'s proxy.
---@param port integer
---@param opts? ExposePortOptions
---@return ExposedPort
function Sandbox:exposePort(port, opts) end

---@param port integer
---@return {success: boolean, port: integer}
function Sandbox:unexposePort(port) end

---The exposed ports, sorted by port.
---@return ExposedPort[]
function Sandbox:getExposedPorts() end

------------------------------------------------------------------------
-- Sessions and commands
------------------------------------------------------------------------

---A persistent shell: cwd, exported env, shell variables and functions carry from one call to the next.
---@class Session: SessionMethods
---@field id string
local Session = {}

---@class ExecOptions
---@field timeout? number ms; overrides the session's commandTimeoutMs; the whole tree is killed, exitCode 124
---@field env? table<string, string|false> this call only
---@field cwd? string this call only
---@field stdin? string fed to the command (without it, it reads EOF)
---@field onOutput? fun(stream: "stdout"|"stderr", data: string) every kept byte, in order
---@field maxOutputBytes? integer per stream (default limits.maxOutputBytes, 16 MiB)
---@field stream? boolean the seed's option (onOutput is called whenever given)
---@field encoding? "utf-8" the seed's option

---@class ExecResult
---@field success boolean exitCode == 0
---@field exitCode integer 128+N when killed by signal N; 124 after a timeout
---@field stdout string the exact bytes
---@field stderr string
---@field command string
---@field duration number ms
---@field timestamp string ISO-8601 UTC
---@field sessionId string
---@field timedOut boolean
---@field truncated boolean output beyond maxOutputBytes was dropped
---@field oomKilled? boolean

---@class ExecEvent
---@field type "start"|"stdout"|"stderr"|"complete"|"error"
---@field command? string start
---@field data? string stdout, stderr
---@field exitCode? integer complete
---@field timedOut? boolean complete
---@field truncated? boolean complete
---@field cancelled? boolean complete, after cancel()
---@field duration? number complete
---@field sessionId? string
---@field timestamp? string
---@field error? MoonboxError error

---An event iterator: `for ev in it do ... end` (iterating waits).
---@class ExecStream
---@field task Task
---@overload fun(): ExecEvent?
local ExecStream = {}

---Kill the command's whole tree (or drop it from the session's queue); iterating on drains the rest.
function ExecStream.cancel() end

---Run a command (a string for the session's shell, or an argv array) and wait for it.
---@param command string|string[]
---@param opts? ExecOptions
---@return ExecResult
function SessionMethods:exec(command, opts) end

---Run a command and iterate over its events as they happen.
---@param command string|string[]
---@param opts? ExecOptions
---@return ExecStream
function SessionMethods:execStream(command, opts) end

---Variables for this session (queued like exec; `false` unsets).
---@param map table<string, string|false>
---@return EnvResult
function Session:setEnvVars(map) end

------------------------------------------------------------------------
-- Background processes
------------------------------------------------------------------------

---@alias ProcessStatus "starting"|"running"|"completed"|"failed"|"killed"|"error"
---@alias Signal string|integer a name ("SIGTERM") or a number

---@class ProcessOptions
---@field processId? string default `proc-<n>`
---@field env? table<string, string|false>
---@field cwd? string
---@field timeout? number ms: the tree is killed, status "killed"
---@field stdin? string
---@field onOutput? fun(stream: "stdout"|"stderr", data: string)
---@field onExit? fun(exitCode: integer)
---@field onStart? fun(process: Process)
---@field autoCleanup? boolean forget the record when it exits
---@field encoding? "utf-8"|"base64" the seed's option: getProcessLogs returns base64

---@class ProcessLogs
---@field stdout string the newest limits.maxLogBytes
---@field stderr string
---@field processId? string
---@field truncated boolean

---@class KillResult
---@field success boolean
---@field processId string
---@field signal Signal
---@field status? ProcessStatus when it was not running

---@class ExitResult
---@field exitCode integer
---@field status ProcessStatus

---@class WaitForLogOptions
---@field plain? boolean the pattern is plain text, not a Lua pattern

---@class LogMatch
---@field line string the line(s) the match is on
---@field match string the matched text
---@field stream "stdout"|"stderr"
---@field captures? (string|integer)[]

---@class WaitForPortOptions
---@field mode? "http"|"tcp" default "http"
---@field path? string default "/"
---@field status? integer|{min: integer, max: integer} default 200-399
---@field timeout? number ms
---@field interval? number ms between probes

---@class PortReady
---@field success boolean
---@field port integer
---@field mode "http"|"tcp"

---A background process.
---@class Process
---@field id string
---@field pid integer the host's pid (the runtime's and a host-side script's view)
---@field sandboxPid integer the pid the sandbox's own processes see (beyond)
---@field command string
---@field status ProcessStatus
---@field startTime string
---@field endTime? string
---@field exitCode? integer
---@field sessionId string
---@field error? string when status is "error"
---@field oomKilled? boolean
local Process = {}

---SIGTERM to the whole tree, SIGKILL after killGraceMs, and waits until the process has ended
---(status "killed" on return); an explicit signal is sent alone, without waiting.
---@param signal? Signal
---@return KillResult
function Process:kill(signal) end

---@return ProcessStatus
function Process:getStatus() end

---@return ProcessLogs
function Process:getLogs() end

---Wait until it exits (waits).
---@param timeoutMs? number
---@return ExitResult
function Process:waitForExit(timeoutMs) end

---Wait until a line of its output matches (waits; buffered output first).
---@param pattern string a Lua pattern unless opts.plain
---@param timeoutMs? number
---@param opts? WaitForLogOptions
---@return LogMatch
function Process:waitForLog(pattern, timeoutMs, opts) end

---Wait until the process's tree accepts connections on port (waits).
---@param port integer
---@param opts? WaitForPortOptions
---@return PortReady
function Process:waitForPort(port, opts) end

---@class ProcessLogEvent
---@field type "stdout"|"stderr"|"exit"
---@field data? string
---@field exitCode? integer
---@field processId string
---@field timestamp string

---An event iterator over a process's logs: buffered output, then live.
---@class LogStream
---@overload fun(): ProcessLogEvent?
local LogStream = {}

---Stop following (a waiting loop ends; the process runs on).
function LogStream.close() end

---Same as close().
function LogStream.cancel() end

---Start a command in the background; returns at once.
---@param command string|string[]
---@param opts? ProcessOptions
---@return Process
function SessionMethods:startProcess(command, opts) end

---Every process of the sandbox, oldest first.
---@return Process[]
function SessionMethods:listProcesses() end

---@param id string
---@return Process? nil when unknown
function SessionMethods:getProcess(id) end

---@param id string
---@param signal? Signal
---@return KillResult
function SessionMethods:killProcess(id, signal) end

---Signal every running process (and ended ones whose descendants live on).
---@param signal? Signal
---@return integer count signalled
function SessionMethods:killAllProcesses(signal) end

---Remove the records of ended processes.
---@return integer count removed
function SessionMethods:cleanupCompletedProcesses() end

---@param id string
---@return ProcessLogs
function SessionMethods:getProcessLogs(id) end

---@param id string
---@return LogStream
function SessionMethods:streamProcessLogs(id) end

------------------------------------------------------------------------
-- Files
------------------------------------------------------------------------

---@class WriteFileOptions
---@field encoding? "utf-8"|"base64"

---@class ReadFileOptions
---@field encoding? "utf-8"|"base64"

---@class FileResult
---@field success boolean
---@field path string
---@field timestamp string

---@class ReadFileResult: FileResult
---@field content string
---@field encoding "utf-8"|"base64"
---@field isBinary boolean
---@field mimeType string
---@field size integer

---@class MkdirOptions
---@field recursive? boolean

---@class MkdirResult: FileResult
---@field recursive boolean

---@class RenameResult: FileResult
---@field newPath string

---@class ListFilesOptions
---@field recursive? boolean
---@field includeHidden? boolean
---@field limit? integer default 10000, at most 100000

---@class FileInfo
---@field name string
---@field absolutePath string
---@field relativePath string
---@field type "file"|"directory"|"symlink"|"other"
---@field size integer
---@field modifiedAt string
---@field mode string
---@field permissions {readable: boolean, writable: boolean, executable: boolean}

---@class ListFilesResult: FileResult
---@field files FileInfo[]
---@field count integer
---@field truncated boolean

---@class ExistsResult: FileResult
---@field exists boolean

---@class WatchOptions
---@field recursive? boolean
---@field include? string[] globs
---@field exclude? string[] globs

---@class WatchEvent
---@field type "create"|"modify"|"delete"|"move"|"overflow"
---@field path string
---@field isDirectory boolean
---@field oldPath? string move
---@field timestamp string

---An event iterator over changes under a path, in place when returned.
---@class WatchStream
---@overload fun(): WatchEvent?
local WatchStream = {}

---Stop watching.
function WatchStream:close() end

---@class GitCheckoutOptions
---@field branch? string
---@field targetDir? string default `/workspace/<repo name>`
---@field depth? integer
---@field timeout? number ms
---@field cloneTimeoutMs? number the seed's name for timeout

---@class GitCheckoutResult
---@field success boolean
---@field repoUrl string
---@field branch string the branch checked out
---@field targetDir string
---@field timestamp string

---@class ChangesOptions
---@field since? string a version an earlier call returned
---@field recursive? boolean
---@field include? string[]
---@field exclude? string[]

---@class ChangesResult
---@field success boolean
---@field status "unchanged"|"changed"|"resync"
---@field version string
---@field reason? "expired"|"restarted"
---@field timestamp string

---Write a file (its parent must exist).
---@param path string
---@param content string
---@param opts? WriteFileOptions
---@return FileResult
function SessionMethods:writeFile(path, content, opts) end

---Read a file; binary content comes back base64 unless opts.encoding says otherwise.
---@param path string
---@param opts? ReadFileOptions
---@return ReadFileResult
function SessionMethods:readFile(path, opts) end

---An iterator of the file's byte chunks.
---@param path string
---@return fun(): string?
function SessionMethods:readFileStream(path) end

---@param path string
---@param opts? MkdirOptions
---@return MkdirResult
function SessionMethods:mkdir(path, opts) end

---Delete a file (a directory raises IS_DIRECTORY).
---@param path string
---@return FileResult
function SessionMethods:deleteFile(path) end

---@param oldPath string
---@param newPath string
---@return RenameResult
function SessionMethods:renameFile(oldPath, newPath) end

---Move a file; an existing directory as destination receives it.
---@param sourcePath string
---@param destinationPath string
---@return RenameResult
function SessionMethods:moveFile(sourcePath, destinationPath) end

---@param path string
---@param opts? ListFilesOptions
---@return ListFilesResult
function SessionMethods:listFiles(path, opts) end

---@param path string
---@return ExistsResult
function SessionMethods:exists(path) end

---@param path string
---@param opts? WatchOptions
---@return WatchStream
function SessionMethods:watch(path, opts) end

---Clone a repository into the sandbox.
---@param repoUrl string
---@param opts? GitCheckoutOptions
---@return GitCheckoutResult
function SessionMethods:gitCheckout(repoUrl, opts) end

---Whether anything under path changed since a version an earlier call returned (waits).
---@param path string
---@param opts? ChangesOptions
---@return ChangesResult
function SessionMethods:checkChanges(path, opts) end

------------------------------------------------------------------------
-- Code interpreter
------------------------------------------------------------------------

---@alias CodeLanguage "python"|"javascript"|"typescript"|"lua"

---@class CodeContextOptions
---@field language? CodeLanguage default "python"
---@field cwd? string
---@field envVars? table<string, string|false>
---@field timeout? number ms per run
---@field id? string

---@class CodeContext
---@field id string
---@field language CodeLanguage
---@field cwd string
---@field createdAt string
---@field lastUsed string
---@field sessionId string

---@class CodeResult
---@field text? string
---@field json? any
---@field html? string
---@field png? string base64
---@field jpeg? string base64
---@field svg? string
---@field markdown? string
---@field latex? string

---@class CodeError
---@field name string e.g. "ZeroDivisionError", "TimeoutError", "InterpreterDied"
---@field message string
---@field traceback string|string[]

---A chunk of a run's output, as the seed's OutputMessage (tostring and ..
---give its text).
---@class OutputMessage
---@field text string
---@field timestamp string ISO-8601 UTC

---@class RunCodeOptions
---@field context? CodeContext|string a context or its id
---@field language? CodeLanguage the default context of this language when no context
---@field timeout? number ms
---@field onStdout? fun(output: OutputMessage)
---@field onStderr? fun(output: OutputMessage)
---@field onResult? fun(result: CodeResult)
---@field onError? fun(error: CodeError)

---@class RunCodeResult
---@field code string
---@field logs {stdout: string[], stderr: string[]}
---@field results CodeResult[]
---@field error? CodeError a user error is reported here, not raised
---@field executionCount integer
---@field truncated boolean
---@field contextRestarted? boolean

---@class CodeEvent
---@field type "stdout"|"stderr"|"result"|"error"|"complete"
---@field text? string
---@field result? CodeResult
---@field error? CodeError
---@field executionCount? integer
---@field contextRestarted? boolean

---Start an interpreter whose state persists across runs (waits until it is ready).
---@param opts? CodeContextOptions
---@return CodeContext
function SessionMethods:createCodeContext(opts) end

---@param code string
---@param opts? RunCodeOptions
---@return RunCodeResult
function SessionMethods:runCode(code, opts) end

---@param code string
---@param opts? RunCodeOptions
---@return fun(): CodeEvent?
function SessionMethods:runCodeStream(code, opts) end

---@return CodeContext[]
function SessionMethods:listCodeContexts() end

---@param id string|CodeContext
---@return {success: boolean, contextId: string}
function SessionMethods:deleteCodeContext(id) end

------------------------------------------------------------------------
-- Terminal
------------------------------------------------------------------------

---@class TerminalOptions
---@field cols? integer default 80
---@field rows? integer default 24
---@field shell? string default "bash"
---@field env? table<string, string|false>

---An interactive shell on a pty.
---@class Terminal
---@field pid integer the host's pid
---@field sandboxPid integer the pid inside the sandbox (beyond)
local Terminal = {}

---@param data string
function Terminal:write(data) end

---Output so far (waits until there is some); nil once the shell exited and all was read.
---@return string?
function Terminal:read() end

---@param fn fun(data: string)
function Terminal:onData(fn) end

---@param cols integer
---@param rows integer
function Terminal:resize(cols, rows) end

---Kill the shell and everything it started (waits).
function Terminal:close() end

---The shell's exit code (waits).
---@return integer
function Terminal:wait() end

---@param opts? TerminalOptions
---@return Terminal
function SessionMethods:terminal(opts) end

------------------------------------------------------------------------
-- Policy
------------------------------------------------------------------------

---@class Limits
---@field commandTimeoutMs? number
---@field maxOutputBytes? integer
---@field maxLogBytes? integer
---@field maxSessions? integer
---@field maxProcesses? integer
---@field maxCompletedProcesses? integer
---@field maxCompletedLogBytes? integer
---@field maxBufferedBytes? integer
---@field maxFileBytes? integer
---@field memoryBytes? integer cgroup v2
---@field pids? integer cgroup v2
---@field cpuTime? number seconds (rlimit)
---@field fileSizeBytes? integer rlimit
---@field openFiles? integer rlimit
---@field egressBytesPerSecond? integer network = "egress": bytes per second it may send
---@field connections? integer network = "egress": connections open at once
---@field killGraceMs? number SIGTERM, then SIGKILL after this (kill())
---@field timeoutGraceMs? number
---@field tmpBytes? integer size of the sandbox's /tmp

---@class Mount
---@field type "bind"|"ro_bind"|"tmpfs"|"proc"|"dev"
---@field src? string
---@field dst string

---Hooks return the (possibly changed) value, or nil and a reason to deny (POLICY_DENIED).
---@class Hooks
---@field onCreateSession? fun(sandbox: Sandbox, opts: SessionOptions): SessionOptions?, string?
---@field onExec? fun(session: Session, command: string|string[], opts: ExecOptions): (string|string[])?, string?
---@field onFile? fun(session: Session, op: string, path: string): string?, string?
---@field onStartProcess? fun(session: Session, command: string|string[], opts: ProcessOptions): (string|string[])?, string?
---@field onEnv? fun(session: Session, map: table<string, string|false>): table<string, string|false>?, string?
---@field onRunCode? fun(session: Session, code: string, opts: {language: string, context: string?}): string?, string?
---@field onTerminal? fun(session: Session, opts: table): table?, string?

---A policy (docs/policy.md).
---@class Policy
---@field limits? Limits
---@field hooks? Hooks
---@field isolation? Isolation
---@field mounts? Mount[]
---@field network? Network
---@field egress? EgressRules
---@field dns? {upstream?: string[]} the egress resolver's upstream servers
---@field hostname? string
---@field seccomp? string profile name, or "none"
---@field idmap? {uid: integer, gid: integer, count: integer}
---@field git? {allowLocal: boolean}
---@field env? table<string, string|false> sandbox-level variables
---@field shell? string the session shell
---@field capabilities? string[] kept in the bounding set under namespaces
---@field userns? table docs/isolation.md
---@field name? string

return moonbox
