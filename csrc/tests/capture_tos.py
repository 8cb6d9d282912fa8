"""Capture TCP packets on an interface with scapy until STOP_FILE appears and write, per
(tos, sport, dport), the packet and payload-byte counts as JSON. READY_FILE is created once
the sniffer runs. Run inside a namespace with `ip netns exec`.
Usage: capture_tos.py IFACE OUT READY_FILE STOP_FILE"""

import json
import os
import sys
import time
from collections import Counter

from scapy.all import IP, TCP, AsyncSniffer


def main():
    iface, out, ready, stop = sys.argv[1:5]
    packets, payload = Counter(), Counter()

    def count(p):
        if IP in p and TCP in p:
            key = f"{p[IP].tos} {p[TCP].sport} {p[TCP].dport}"
            packets[key] += 1
            payload[key] += len(p[TCP].payload)

    sniffer = AsyncSniffer(iface=iface, prn=count, store=False)
    sniffer.start()
    time.sleep(0.3)
    open(ready, "w").close()
    deadline = time.monotonic() + 300
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.05)
    sniffer.stop()
    with open(out, "w") as f:
        json.dump({k: [packets[k], payload[k]] for k in packets}, f)


if __name__ == "__main__":
    main()
