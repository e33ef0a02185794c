#!/usr/bin/python3
"""A tiny authoritative DNS server for the egress specs' "internet" (stdlib only).

dns_server.py ADDR NAME=A1[/A2][@TTL] ...: answers A queries for each NAME
(exact match, TTL 1 unless @TTL says) with A1; with A2, the first query
gets A1 and every later one A2 (a rebinding name). NAME=silent: never
answered (an upstream that does not answer). AAAA and other types of a
known name: an empty answer; unknown names: NXDOMAIN. UDP port 53 only.
"""
import socket
import struct
import sys


def parse_name(data, off):
    labels = []
    while True:
        n = data[off]
        off += 1
        if n == 0:
            return ".".join(labels).lower(), off
        labels.append(data[off:off + n].decode("ascii", "replace"))
        off += n


def main():
    addr = sys.argv[1]
    zones = {}
    ttls = {}
    for arg in sys.argv[2:]:
        name, answers = arg.split("=", 1)
        answers, _, ttl = answers.partition("@")
        zones[name.lower()] = answers.split("/")
        ttls[name.lower()] = int(ttl or "1")
    asked = {}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((addr, 53))
    print("ready", flush=True)
    while True:
        data, peer = sock.recvfrom(512)
        if len(data) < 12:
            continue
        qid, _flags, qd = struct.unpack("!HHH", data[:6])
        if qd != 1:
            continue
        try:
            name, off = parse_name(data, 12)
        except IndexError:
            continue
        qtype, _qclass = struct.unpack("!HH", data[off:off + 4])
        question = data[12:off + 4]
        if zones.get(name) == ["silent"]:
            continue
        answers = []
        rcode = 3
        if name in zones:
            rcode = 0
            if qtype == 1:
                n = asked.get(name, 0)
                asked[name] = n + 1
                choices = zones[name]
                answers = [choices[min(n, len(choices) - 1)]]
        flags = 0x8400 | rcode  # response, authoritative
        header = struct.pack("!HHHHHH", qid, flags, 1, len(answers), 0, 0)
        body = b""
        for a in answers:
            body += b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, ttls[name], 4) + socket.inet_aton(a)
        sock.sendto(header + question + body, peer)


if __name__ == "__main__":
    main()
