#!/usr/bin/env python3
"""What the kernel's first touch of fresh anonymous memory costs on this box, on 2 MiB and on
4 KiB pages (``io.pages.first_touch_s_per_gb``: ``MADV_POPULATE_WRITE`` of a fresh mapping),
right after the same amount was freed and after a pause: where the kernel reports free pages
to a hypervisor, memory freed a moment ago is still the guest's and cheap, memory free for a
while was handed back. Prints whether this box reports free pages (``io.pages.page_reporting``)
and the page size a RAM-tier slab takes here.

    .venv/bin/python bench/first_touch.py --mib 256 --pauses 0,0,3,0,6,0
"""

from __future__ import annotations

import argparse
import time

from expertfs.runtime.io.pages import first_touch_s_per_gb, huge_pages_pay, page_reporting


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB faulted in per point (256)")
    ap.add_argument("--pauses", default="0,0,3,0,6,0",
                    help="seconds to wait before each pair of points")
    a = ap.parse_args()
    print(f"free page reporting: {'on' if page_reporting() else 'off'}; "
          f"RAM-tier slabs on {'2 MiB' if huge_pages_pay() else '4 KiB'} pages")
    print("pause s   2 MiB pages s/GB   4 KiB pages s/GB")
    for p in (float(x) for x in a.pauses.split(",")):
        time.sleep(p)
        huge = first_touch_s_per_gb(True, a.mib << 20)
        small = first_touch_s_per_gb(False, a.mib << 20)
        print(f"{p:7.0f}   {_fmt(huge):>16}   {_fmt(small):>16}")


if __name__ == "__main__":
    main()
