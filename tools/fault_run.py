"""A short fault-injection run: per fault class, the cases tried and the cases survived.

"Survived" means nothing was lost, no wrong token was served and a clear error came where one was
due: a killed trace writer leaves a file that loads up to its last complete chunk (and says it is
unfinished when read strictly) and a store that still verifies, byte for byte; a transient read
fault gives the clean run's tokens; a persistent one raises a typed error naming the layer,
expert and file, after which the engine gives the clean tokens again; a store truncated or
replaced under the engine raises ``StoreChangedError``. Decodes run on a tiny synthesised store
through the tiered provider with the test suite's fault-injecting backend::

    .venv/bin/python tools/fault_run.py [--kills 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from expertfs.runtime.io import ExpertIntegrityError, IOFaultError  # noqa: E402
from expertfs.runtime.io.errors import StoreChangedError  # noqa: E402
from expertfs.runtime.trace.file import TraceError, TraceReader, read_trace  # noqa: E402
from expertfs.store.verify import verify  # noqa: E402
from support.cache_store import make_store  # noqa: E402
from support.faults import Fault, FaultyRun  # noqa: E402

_RUN = """import sys
from expertfs.runtime.trace import file
file.TraceWriter.__init__.__kwdefaults__["chunk_rows"] = 32
from expertfs.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _kill_run(store: Path, work: Path, i: int, delay: float) -> str | None:
    """Kill ``expertfs run --trace`` mid-run; None when it survived, else what went wrong."""
    before = (store / "experts.bin").read_bytes()
    script, trace = work / "run.py", work / f"kill{i}.eftrace"
    script.write_text(_RUN)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "tests"))
    proc = subprocess.Popen([sys.executable, str(script), "run", str(store), "-p", "hello", "-n",
                             "100000", "--ignore-eos", "--fused", "off", "--trace", str(trace)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while not (trace.exists() and trace.stat().st_size > 400):
        if proc.poll() is not None or time.monotonic() - t0 > 60:
            proc.kill()
            return "the run ended before writing its trace"
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    try:
        read_trace(trace)
        return "a killed run's trace read as finished"
    except TraceError:
        pass
    with TraceReader(trace, allow_partial=True) as r:
        n = sum(len(c) for c in r.chunks())
    if r.complete is not False or n == 0 or n % 32:
        return f"{n} rows loaded"
    if not verify(str(store)).ok or (store / "experts.bin").read_bytes() != before:
        return "the store changed"
    return None


def _decode_case(path: Path, clean: list[int], verify_mode: str,
                 act: Callable[[FaultyRun], None], error: type[BaseException] | None) -> str | None:
    """One decode with ``act`` done after the prefill; None when it survived."""
    r = FaultyRun(path, verify=verify_mode)
    try:
        try:
            got = r.tokens(act)
        except BaseException as e:  # noqa: BLE001 - judged below
            if error is None or not isinstance(e, error):
                return f"raised {type(e).__name__}: {e}"
            msg = str(e)
            if e.layer is None or f"layer {e.layer}, expert {e.expert}" not in msg \
                    or str(path) not in msg:
                return f"error does not name layer, expert and file: {msg}"
            if error is StoreChangedError:
                return None
            r.clear()
            return None if r.tokens() == clean else "wrong tokens after the error"
        if error is not None:
            return f"no error (tokens {'equal' if got == clean else 'WRONG'})"
        if sum(r.faults.hits.values()) == 0:
            return "the fault never fired"
        return None if got == clean else f"wrong tokens {got} != {clean}"
    finally:
        r.close()


def _fault(f: Fault) -> Callable[[FaultyRun], None]:
    return lambda run: run.faults.add(f)


def _truncate(size: int) -> Callable[[FaultyRun], None]:
    def act(run: FaultyRun) -> None:
        n = os.path.getsize(run.store.experts_path)
        os.truncate(run.store.experts_path, size if size > 0 else n // 2)
    return act


def _replace(how: str) -> Callable[[FaultyRun], None]:
    def act(run: FaultyRun) -> None:
        bins = run.store.experts_path
        data = bytes(b ^ 0x55 for b in Path(bins).read_bytes())
        if how == "rename":
            Path(bins + ".new").write_bytes(data)
            os.replace(bins + ".new", bins)
        else:
            st = os.stat(bins)
            with open(bins, "r+b") as f:
                f.write(data)
            os.utime(bins, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    return act


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=4, help="SIGKILLs of `expertfs run --trace`")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    results: dict[str, list[str | None]] = {}
    with tempfile.TemporaryDirectory(prefix="fault_run_") as tmp:
        work = Path(tmp)
        store = make_store(work)
        probe = FaultyRun(store)
        try:
            clean = probe.tokens()
        finally:
            probe.close()
        results["kill during trace write"] = [_kill_run(store, work, i, rng.uniform(0, 1.0))
                                              for i in range(args.kills)]
        cases: list[tuple[str, str, Callable[[FaultyRun], None], type | None]] = []
        for t in (1, 2):
            cases.append(("EIO transient", "first", _fault(Fault("eio", times=t)), None))
        cases.append(("EIO persistent", "first", _fault(Fault("eio", times=-1)), IOFaultError))
        for t, keep in ((3, None), (2, 0), (1, 1)):
            cases.append(("short read transient", "first",
                          _fault(Fault("short", times=t, keep=keep)), None))
        cases.append(("short read persistent", "first", _fault(Fault("short", times=-1, keep=0)),
                      IOFaultError))
        for t in (1, 2):
            cases.append(("checksum mismatch transient", "always",
                          _fault(Fault("corrupt", times=t)), None))
        cases.append(("checksum mismatch persistent", "always",
                      _fault(Fault("corrupt", times=-1)), ExpertIntegrityError))
        for size in (4096, 0):
            cases.append(("store truncated", "first", _truncate(size), StoreChangedError))
        for how in ("rename", "rewrite"):
            cases.append(("store replaced", "first", _replace(how), StoreChangedError))
        for i, (cls, mode, act, err) in enumerate(cases):
            path = store
            if cls.startswith("store"):
                path = work / f"copy{i}.efs"
                shutil.copytree(store, path)
            results.setdefault(cls, []).append(_decode_case(path, clean, mode, act, err))
    print(f"{'fault class':<30} {'tried':>5} {'survived':>8}")
    for cls, outs in results.items():
        print(f"{cls:<30} {len(outs):>5} {sum(o is None for o in outs):>8}")
    failed = [(cls, o) for cls, outs in results.items() for o in outs if o is not None]
    for cls, o in failed:
        print(f"NOT SURVIVED  {cls}: {o}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
