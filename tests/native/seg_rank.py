"""A rank process for the segment tests: opens a SharedRegion and obeys line commands.

Usage: seg_rank.py UNIQUE_ID CTRL_BYTES DATA_BYTES SEGMENT_BYTES ROLE [DELAY_S]

Prints one JSON line after open ({"event": "open", ...} or {"event": "error", ...}), then per
command on stdin one JSON line:
  wctrl OFF HEX | wdata OFF HEX   write bytes at an offset of the ctrl / data region
  rctrl OFF N   | rdata OFF N     read N bytes -> {"hex": ...}
  close                           close the region -> {"seconds": ...}
  exit                            exit without calling close
The creator's init writes b"INIT" + its pid (8 bytes LE) at ctrl offset 0 and b"DATA" at the
start of every data segment (a worker only: a scheduler maps no data).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

from ucm.native.segments import SharedRegion


def main() -> None:
    unique_id, ctrl_bytes, data_bytes, segment_bytes, role = sys.argv[1:6]
    delay_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    time.sleep(delay_s)

    def init(region: SharedRegion) -> None:
        ctypes.memmove(region.ctrl_address, b"INIT" + os.getpid().to_bytes(8, "little"), 12)
        # A scheduler does not map the data (data_address is 0).
        for index in range(region.segment_count if region.data_address else 0):
            ctypes.memmove(region.segment_address(index), b"DATA", 4)

    try:
        region = SharedRegion.open(
            unique_id,
            int(ctrl_bytes),
            int(data_bytes),
            int(segment_bytes),
            "scheduler" if role == "scheduler" else "worker",
            init=init,
            timeout_s=20.0,
        )
    except Exception as exc:
        print(json.dumps({"event": "error", "type": type(exc).__name__, "message": str(exc)}))
        return
    head = ctypes.string_at(region.ctrl_address, 12)
    print(
        json.dumps(
            {
                "event": "open",
                "pid": os.getpid(),
                "created": region.created,
                "replaced_stale": region.replaced_stale,
                "stale_creator_pid": region.stale_creator_pid,
                "creator_pid": region.creator_pid,
                "init_pid": int.from_bytes(head[4:12], "little") if head[:4] == b"INIT" else 0,
                "data_address": region.data_address,
                "huge_pages": region.huge_pages,
                "serves_data": region.serves_data,
            }
        ),
        flush=True,
    )
    for line in sys.stdin:
        words = line.split()
        reply: dict[str, object] = {"ok": True}
        if words[0] in ("wctrl", "wdata"):
            base = region.ctrl_address if words[0] == "wctrl" else region.data_address
            payload = bytes.fromhex(words[2])
            ctypes.memmove(base + int(words[1]), payload, len(payload))
        elif words[0] in ("rctrl", "rdata"):
            base = region.ctrl_address if words[0] == "rctrl" else region.data_address
            reply["hex"] = ctypes.string_at(base + int(words[1]), int(words[2])).hex()
        elif words[0] == "close":
            start = time.monotonic()
            region.close()
            reply["seconds"] = time.monotonic() - start
        elif words[0] == "exit":
            print(json.dumps(reply), flush=True)
            return
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
