"""Server-Sent Events, parsed by hand: the server sends one ``data: {json}``
record per event (blank-line terminated); ``data`` lines of one record are
joined with newlines, comments (``:``) and other fields are ignored."""
from __future__ import annotations

import json
from typing import Any, BinaryIO, Dict, Iterator, List

from .errors import MoonboxError

# A record larger than this is refused: the client's memory stays bounded
# whatever the server (or something posing as it) sends.
MAX_EVENT_BYTES = 64 * 1024 * 1024


def events(stream: BinaryIO, max_event_bytes: int = MAX_EVENT_BYTES) -> Iterator[Dict[str, Any]]:
    """Yield each event's decoded JSON object from a readable byte stream."""
    data: List[bytes] = []
    size = 0
    while True:
        line = stream.readline(max_event_bytes + 2)
        if not line:
            break
        if not line.endswith(b"\n"):
            if len(line) > max_event_bytes:
                raise MoonboxError("BAD_RESPONSE", "an event stream line is longer than %d bytes" % max_event_bytes)
            # the last line of a stream cut short: not a whole record
            break
        line = line.rstrip(b"\r\n")
        if line == b"":
            if data:
                yield _decode(b"\n".join(data))
            data, size = [], 0
            continue
        if line.startswith(b":"):
            continue
        field, _, value = line.partition(b":")
        if field != b"data":
            continue
        if value.startswith(b" "):
            value = value[1:]
        size += len(value) + 1
        if size > max_event_bytes:
            raise MoonboxError("BAD_RESPONSE", "an event is larger than %d bytes" % max_event_bytes)
        data.append(value)


def _decode(raw: bytes) -> Dict[str, Any]:
    try:
        ev = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise MoonboxError("BAD_RESPONSE", "an event is not JSON: %s" % e) from None
    if not isinstance(ev, dict):
        raise MoonboxError("BAD_RESPONSE", "an event is not a JSON object")
    return ev
