#!/usr/bin/env python3
# moonbox code-interpreter kernel protocol (shared by the python, node and lua kernels):
#   stdin: one JSON request per line: {"id": n, "code": "<source>"}
#   fd 3:  one JSON message per line, flushed at once: {"type":"ready","language","version"} at start; per request
#          0+ {"id","type":"result","data":{"text","json"?,"html"?,"png"?,...}} / {"id","type":"error","error":
#          {"name","message","traceback"}}, then one {"id","type":"done","executionCount"}. fd 1/2: raw user output
#   fd 1/2: the user code's own stdout/stderr, raw (not JSON); flushed before each result and before "done"
"""Python kernel for moonbox code-interpreter contexts (stdlib only; IPython/matplotlib used when present)."""

import os
import sys

os.environ.setdefault("MPLBACKEND", "Agg")  # before any user import of matplotlib

import ast
import builtins
import json

KERNEL_FILE = os.path.abspath(__file__)
_kernel_files = {KERNEL_FILE, __file__}

# ---------------------------------------------------------------- protocol fds

def _setup_fds():
    """Take private, close-on-exec copies of the request (0) and message (3) fds, so that user code
    (input(), subprocesses, os.close(3)) can neither read requests nor write protocol messages."""
    try:
        out_fd = os.dup(3)          # os.dup gives a non-inheritable fd
    except OSError:
        sys.stderr.write("python_kernel: fd 3 (protocol channel) is not open\n")
        sys.exit(2)
    os.close(3)
    in_fd = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd in (1, 2, out_fd, in_fd):
        try:
            os.set_blocking(fd, True)
        except OSError:
            pass
    return os.fdopen(in_fd, "rb", buffering=1 << 16), out_fd


_req_in, _msg_fd = _setup_fds()
# User output streams as soon as a line is complete (the runtime reads fd 1/2 pipes and streams them).
# Not write-through (-u makes it so): a print() is one write, so one log entry, not "hi" then "\n".
for _s in (sys.stdout, sys.stderr):
    try:
        _s.reconfigure(line_buffering=True, write_through=False)
    except Exception:
        pass


def send(msg):
    data = (json.dumps(msg, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        n = os.write(_msg_fd, view)
        view = view[n:]


def flush_user_output():
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if s is not None:
                s.flush()
        except Exception:
            pass


# ---------------------------------------------------------------- formatting

_PRIMITIVES = (str, int, float, bool, complex, bytes, type(None))
_CONTAINERS = (dict, list, tuple, set, frozenset)
_MIME_KEYS = (
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("text/latex", "latex"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/json", "json"),
)
_REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_latex_", "text/latex"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_json_", "application/json"),
)

_ipython_formatter = None   # False once IPython is known to be missing


def _get_ipython_formatter():
    global _ipython_formatter
    if _ipython_formatter is None:
        try:
            from IPython.core.formatters import DisplayFormatter
            _ipython_formatter = DisplayFormatter()
        except Exception:
            _ipython_formatter = False
    return _ipython_formatter


def _is_builtin_value(value):
    """Values whose repr is all there is: formatted without importing IPython (~0.4-0.5 s)."""
    t = type(value)
    if t in _PRIMITIVES:
        return True
    if t in _CONTAINERS:
        return True
    return False


def _base64(data):
    import base64
    if isinstance(data, str):
        return "".join(data.split())   # already base64 (IPython/Jupyter convention for str image data)
    return base64.b64encode(bytes(data)).decode("ascii")


def _unwrap(v):
    # _repr_*_ methods may return (data, metadata)
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], dict):
        return v[0]
    return v


def _bundle_to_data(bundle):
    """Jupyter mime bundle -> protocol data dict."""
    data = {}
    for mime, key in _MIME_KEYS:
        if mime not in bundle:
            continue
        v = _unwrap(bundle[mime])
        if v is None:
            continue
        try:
            if key in ("png", "jpeg"):
                v = _base64(v)
            elif key == "json":
                json.dumps(v, allow_nan=False)
            else:
                if isinstance(v, bytes):
                    v = v.decode("utf-8", "replace")
                v = str(v)
        except Exception:
            continue
        data[key] = v
    return data


def _figure_png(fig):
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return _base64(buf.getvalue())


def _is_mpl_figure(value):
    mod = sys.modules.get("matplotlib.figure")
    return mod is not None and isinstance(value, mod.Figure)


def _fallback_bundle(value):
    bundle = {}
    if not isinstance(value, type):
        m = getattr(value, "_repr_mimebundle_", None)
        if callable(m):
            try:
                r = m(include=None, exclude=None)
                if isinstance(r, tuple):
                    r = r[0]
                if isinstance(r, dict):
                    bundle.update(r)
            except Exception:
                pass
        for meth, mime in _REPR_METHODS:
            if mime in bundle:
                continue
            m = getattr(value, meth, None)
            if not callable(m):
                continue
            try:
                r = m()
            except Exception:
                continue
            if r is not None:
                bundle[mime] = r
    if "text/plain" not in bundle:
        bundle["text/plain"] = _plain_text(value)
    return bundle


def _plain_text(value):
    if type(value) in _CONTAINERS:
        r = repr(value)
        if len(r) <= 79:
            return r
        import pprint
        return pprint.pformat(value, width=79, sort_dicts=False)
    return repr(value)


def format_value(value):
    """Return the protocol `data` dict for a value (never None)."""
    if _is_mpl_figure(value):
        data = {"text": repr(value)}
        try:
            data["png"] = _figure_png(value)
        except Exception as e:  # noqa: BLE001
            data["text"] += " (png rendering failed: %s)" % e
        return data
    data = None
    if not _is_builtin_value(value) or "IPython" in sys.modules:
        fmt = _get_ipython_formatter()
        if fmt:
            import io
            real_stderr, sys.stderr = sys.stderr, io.StringIO()   # IPython prints formatter tracebacks
            try:
                bundle, _md = fmt.format(value)
                data = _bundle_to_data(bundle)
            except Exception:
                data = None
            finally:
                noise, sys.stderr = sys.stderr.getvalue(), real_stderr
            if data is not None and "text" not in data:
                data["text"] = repr(value)   # a broken __repr__: raise it as the run's error
            if noise:
                sys.stderr.write(noise)      # e.g. why a _repr_html_ gave nothing
    if data is None:
        try:
            data = _bundle_to_data(_fallback_bundle(value))
        except Exception:
            data = {}
    if "text" not in data:
        data["text"] = repr(value)   # a broken __repr__ raises here: reported as the run's error
    if "json" not in data and type(value) in (dict, list):
        try:
            data["json"] = json.loads(json.dumps(value, allow_nan=False))
        except Exception:
            pass
    return data


# ---------------------------------------------------------------- execution state

_current_id = None
_execution_count = 0
_last_value = object()     # what `_` was last set to by the kernel
_emitted_figures = set()   # id()s of figures already sent during the current run


def emit_result(data):
    flush_user_output()
    send({"id": _current_id, "type": "result", "data": data})


def display(*objs, raw=False, **_kwargs):
    """Show objects as results of the current run (like IPython's display()).
    With raw=True each obj is a mime bundle dict, e.g. {"text/html": "<b>hi</b>"}."""
    for obj in objs:
        if raw and isinstance(obj, dict):
            data = _bundle_to_data(obj)
            if "text" not in data:
                data["text"] = ""
        else:
            if _is_mpl_figure(obj):
                _emitted_figures.add(id(obj))
            data = format_value(obj)
        emit_result(data)


def _install_ipython_display_hook():
    """IPython's own display() only print()s outside an IPython shell; route it to ours instead by
    patching IPython.core.display_functions as soon as it is imported (by the user or by us)."""
    import importlib.machinery   # (importlib.abc would cost ~40 ms of startup; a duck-typed finder will do)

    target = "IPython.core.display_functions"

    class _Finder:
        def find_spec(self, name, path, target_mod=None):
            if name != target:
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            orig_exec = spec.loader.exec_module

            def exec_module(module):
                orig_exec(module)
                module.display = display
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


_install_ipython_display_hook()

# User code's globals are the dict of a fresh `__main__` module that replaces the kernel's in sys.modules,
# so pickle, dataclasses, typing.get_type_hints etc. find user classes through sys.modules["__main__"].
_user_main = type(sys)("__main__")
user_ns = _user_main.__dict__
user_ns.update({"__builtins__": builtins, "display": display})
sys.modules["__main__"] = _user_main
builtins.display = display
_loop = None


def _event_loop():
    """The main thread's event loop (the one asyncio.get_event_loop() / ensure_future() in user code use),
    created on first need and kept for the kernel's life, so tasks survive between runs."""
    global _loop
    import asyncio
    import warnings
    if _loop is None or _loop.is_closed():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _loop = asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            _loop = None
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
    return _loop


def _run_code_object(code):
    import inspect
    if code.co_flags & inspect.CO_COROUTINE:
        return _event_loop().run_until_complete(eval(code, user_ns))
    return eval(code, user_ns)


def _trim_kernel_frames(tb):
    while tb is not None and tb.tb_frame.f_code.co_filename in _kernel_files:
        tb = tb.tb_next
    return tb


def error_payload(exc, compile_error=False):
    import traceback
    etype = type(exc)
    if compile_error:
        lines = traceback.format_exception_only(etype, exc)
    else:
        tb = _trim_kernel_frames(exc.__traceback__)
        exc.__traceback__ = tb
        lines = traceback.format_exception(etype, exc, tb)
    try:
        message = str(exc)
    except Exception:
        message = "<unprintable %s>" % etype.__name__
    return {"name": etype.__name__, "message": message, "traceback": "".join(lines)}


def _flush_pyplot_figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        nums = plt.get_fignums()
    except Exception:
        return
    for num in nums:
        try:
            fig = plt.figure(num)
            if id(fig) not in _emitted_figures:
                emit_result({"text": repr(fig), "png": _figure_png(fig)})
        except Exception as e:  # noqa: BLE001
            sys.stderr.write("moonbox: could not render figure %s: %s\n" % (num, e))
    try:
        plt.close("all")
    except Exception:
        pass


def _ends_with_semicolon(code):
    # IPython convention: a trailing ';' hides the final expression's value.
    stripped = code.rstrip()
    return stripped.endswith(";")


def execute(code):
    global _execution_count, _last_value
    import linecache
    _execution_count += 1
    filename = "<cell-%d>" % _execution_count
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    flags = getattr(ast, "PyCF_ALLOW_TOP_LEVEL_AWAIT", 0)
    try:
        tree = ast.parse(code, filename=filename, mode="exec")
        last_expr = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code):
            last_expr = ast.Expression(tree.body.pop().value)
        body_code = compile(tree, filename, "exec", flags=flags, dont_inherit=True) if tree.body else None
        expr_code = compile(last_expr, filename, "eval", flags=flags, dont_inherit=True) if last_expr else None
    except (SyntaxError, ValueError, OverflowError, MemoryError) as e:
        send({"id": _current_id, "type": "error", "error": error_payload(e, compile_error=True)})
        return
    _emitted_figures.clear()
    try:
        if body_code is not None:
            _run_code_object(body_code)
        if expr_code is not None:
            value = _run_code_object(expr_code)
            if value is not None:
                if user_ns.get("_", _last_value) is _last_value:   # never clobber a user's own `_`
                    user_ns["_"] = _last_value = value
                if _is_mpl_figure(value):
                    _emitted_figures.add(id(value))
                emit_result(format_value(value))
    except BaseException as e:  # noqa: BLE001  (SystemExit / KeyboardInterrupt are reported too)
        flush_user_output()
        send({"id": _current_id, "type": "error", "error": error_payload(e)})
    finally:
        try:
            _flush_pyplot_figures()
        except BaseException:
            pass


def handle_line(line):
    global _current_id
    try:
        req = json.loads(line)
        if not isinstance(req, dict):
            raise ValueError("request is not a JSON object")
    except ValueError as e:
        send({"id": None, "type": "error",
              "error": {"name": "ProtocolError", "message": "bad request: %s" % e, "traceback": ""}})
        send({"id": None, "type": "done", "executionCount": _execution_count})
        return
    _current_id = req.get("id")
    code = req.get("code")
    if not isinstance(code, str):
        send({"id": _current_id, "type": "error",
              "error": {"name": "ProtocolError", "message": "request has no string \"code\"", "traceback": ""}})
    else:
        try:
            execute(code)
        except BaseException as e:  # noqa: BLE001  (e.g. KeyboardInterrupt while formatting)
            send({"id": _current_id, "type": "error", "error": error_payload(e)})
    flush_user_output()
    send({"id": _current_id, "type": "done", "executionCount": _execution_count})


def main():
    send({"type": "ready", "language": "python",
          "version": "%d.%d.%d" % sys.version_info[:3], "implementation": sys.implementation.name})
    while True:
        try:
            line = _req_in.readline()
        except KeyboardInterrupt:      # SIGINT while idle: nothing to interrupt
            continue
        if not line:
            break                      # runtime closed our stdin: shut down
        if not line.strip():
            continue
        try:
            handle_line(line)
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    main()
