"""The command line: exit codes, one-line errors, JSON output, ``python -m expertfs``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from expertfs.cli import main
from support.gguf_builders import moe_gguf


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "expertfs", *args], capture_output=True,
                          text=True, timeout=120)


def test_repack_verify_inspect_unpack(tmp_path, tiny_gguf, capsys):
    store = tmp_path / "s.efs"
    assert main(["repack", str(tiny_gguf), "-o", str(store), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["store"] == str(store) and out["moe_layers"] == 2
    assert main(["verify", str(store), "--source", str(tiny_gguf)]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["inspect", str(store), "--json", "--extents"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "store" and len(info["extent_list"]) == 8
    assert main(["inspect", str(tiny_gguf)]) == 0
    text = capsys.readouterr().out
    assert "used per token: 2" in text and "per expert" in text
    assert main(["unpack", str(store), "-o", str(tmp_path / "b.gguf")]) == 0
    assert (tmp_path / "b.gguf").read_bytes() == tiny_gguf.read_bytes()


def test_verify_exit_1_lists_bad_extents(tmp_path, tiny_gguf, capsys):
    store = tmp_path / "s.efs"
    main(["repack", str(tiny_gguf), "-o", str(store)])
    with open(store / "experts.bin", "r+b") as f:
        f.write(b"\x01\x02\x03")
    assert main(["verify", str(store)]) == 1
    assert "layer 0 expert 0" in capsys.readouterr().err


@pytest.mark.parametrize("make,args,match", [
    (lambda p: p.write_bytes(b"not a model at all, just text" * 4), ["repack", "{f}", "-o", "{o}"], "not a GGUF"),
    (lambda p: p.write_bytes(b"GGUF" + bytes(4)), ["repack", "{f}", "-o", "{o}"], "header"),
    (lambda p: moe_gguf(p, dense=True), ["repack", "{f}", "-o", "{o}"], "dense"),
    (lambda p: None, ["repack", "{f}", "-o", "{o}"], "cannot open"),
    (lambda p: None, ["verify", "{o}"], "no such store"),
    (lambda p: p.mkdir(), ["inspect", "{f}"], "directory"),
    (lambda p: moe_gguf(p), ["repack", "{f}", "-o", "{f}", "--force"], "overwrite the model"),
    (lambda p: moe_gguf(p), ["repack", "{f}", "-o", "/nonexistent-dir/x.efs"], "does not exist"),
    (lambda p: moe_gguf(p), ["repack", "{f}", "-o", "{o}", "--align", "3000"], "power of two"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, make, args, match):
    f, o = tmp_path / "in.gguf", tmp_path / "out.efs"
    make(f)
    r = run(*[a.format(f=f, o=o) for a in args])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr
    assert not o.exists() and not Path(str(o) + ".partial").exists()


def test_existing_output_refused(tmp_path, tiny_gguf):
    o = tmp_path / "o.efs"
    assert run("repack", str(tiny_gguf), "-o", str(o)).returncode == 0
    r = run("repack", str(tiny_gguf), "-o", str(o))
    assert r.returncode == 2 and "--force" in r.stderr
    r = run("unpack", str(o), "-o", str(tiny_gguf))
    assert r.returncode == 2 and "already exists" in r.stderr


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    for c in ("repack", "verify", "inspect", "unpack"):
        assert c in r.stdout


def test_a_command_imports_only_its_own_module(tmp_path, tiny_gguf):
    """``expertfs repack`` builds only its own parser, so it starts without torch (as
    ``verify`` and ``unpack`` do); ``bench`` is both of its modules; a mistyped command still
    lists them all."""
    code = ("import sys; from expertfs.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "repack", str(tiny_gguf), "-o",
                          str(tmp_path / "s.efs")], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines()[-1] == "0 False"
    from expertfs.cli import _command, build_parser
    assert _command(["-v", "run", "x.efs", "-n", "4"]) == "run"
    assert _command(["--help"]) is None and _command([]) is None
    sub = build_parser("bench")._subparsers._group_actions[0].choices
    assert list(sub) == ["bench"] and set(sub["bench"]._subparsers._group_actions[0].choices) == {"io", "cache"}
    bad = run("runn", "x")
    assert bad.returncode == 2 and "'run'" in bad.stderr and "'serve'" in bad.stderr
