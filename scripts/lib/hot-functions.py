#!/usr/bin/env python3
"""The functions a running process has touched: the mangled names of BINARY's .text
functions that overlap the process's present code pages (/proc/PID/pagemap), in address
order. Run as root on a process started from a file system with no readahead (see
scripts/link-order), so that present pages are the pages it ran.
usage: hot-functions.py PID BINARY OUT"""
import sys, subprocess, re, struct
pid, binary, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
PAGE = 4096
loads = []
for l in subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True).stdout.splitlines():
    p = l.split()
    if p and p[0] == "LOAD":
        loads.append((int(p[1], 16), int(p[2], 16), int(p[4], 16)))
text = None
for l in subprocess.run(["readelf", "-SW", binary], capture_output=True, text=True).stdout.splitlines():
    m = re.match(r"\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+([0-9a-f]+)\s+([0-9a-f]+)\s+([0-9a-f]+)", l)
    if m and m.group(1) == ".text":
        text = (int(m.group(2), 16), int(m.group(4), 16))
syms = []
for l in subprocess.run(["nm", "-S", "--defined-only", binary], capture_output=True, text=True).stdout.splitlines():
    p = l.split(" ", 3)
    if len(p) == 4 and p[2] in "tT" and text[0] <= int(p[0], 16) < text[0] + text[1]:
        syms.append((int(p[0], 16), int(p[1], 16), p[3]))
syms.sort()
present = set()
pm = open(f"/proc/{pid}/pagemap", "rb")
for l in open(f"/proc/{pid}/maps"):
    p = l.split()
    if len(p) < 6 or p[5] != binary or "x" not in p[1]:
        continue
    a, b = (int(x, 16) for x in p[0].split("-")); off = int(p[2], 16)
    for va in range(a, b, PAGE):
        pm.seek(va // PAGE * 8)
        if struct.unpack("<Q", pm.read(8))[0] >> 63 & 1:
            fo = off + va - a
            for o, v, sz in loads:
                if o <= fo < o + sz:
                    present.add((v + fo - o) // PAGE)
hot = [s for s in syms if any(pg in present for pg in range(s[0] // PAGE, (s[0] + max(s[1], 1) - 1) // PAGE + 1))]
with open(out, "w") as f:
    for s in hot:
        f.write(s[2] + "\n")
print(f"present text pages {len(present)} ({len(present)*PAGE/1048576:.2f} MiB); hot functions {len(hot)} of {len(syms)}, {sum(s[1] for s in hot)/1048576:.2f} MiB of {sum(s[1] for s in syms)/1048576:.2f}")
