"""moonbox: a Python client for `moonbox serve` (docs/clients.md).

    from moonbox import Client
    sb = Client("http://127.0.0.1:8080", token).get_sandbox("demo")
    print(sb.exec("echo hi")["stdout"])
"""
from .client import Client, Process, Sandbox, Session
from .errors import MoonboxError

__all__ = ["Client", "Sandbox", "Session", "Process", "MoonboxError"]
__version__ = "0.1.0"
